"""Self-test of the store scenarios: each store control is flagged, its reference is not.

``SkipsStoreLoad`` (``kvfail.conformance.negative``) is vLLM's ExampleConnector with its
load skipped: the scheduler counts the stored prefix as loaded and D runs on blocks that
never got P's bytes, and nothing is reported. ``LoadsFromLastChild`` is vLLM's
MultiConnector routing a load to the last matching child, which reads a bystander's
bytes; ``DropsStoreLoadErrors`` is vLLM's MooncakeStoreConnector reporting a failed get as
a finished load. On kvfail's own Example connector (``connectors/example``):
``SkipsDigestCheck`` loads each file without checking its digest, and ``DropsChildErrors``
is vLLM's MultiConnector over two of them dropping what its children report. Only the
drivers' oracles can see them; the unbroken connector (``STORE_REFERENCES``) must be
judged on the same scenario without the control's finding (a flag is evidence only where
the reference does not show it). Run in one inner session, like the other controls
(``test_negative_controls.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import kvfail.conformance.mooncake_store_driver
import kvfail.conformance.multi_driver
import kvfail.conformance.negative as negative
import kvfail.conformance.store_driver  # noqa: F401 - these three loaded before the inner session
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

STORE = SCENARIOS / "test_store_faults.py"


@pytest.fixture(scope="module")
def store_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("kvfail-store-report")
    scenarios = sorted(
        {negative.STORE_SELECT.get(c, f.scenario) for c, f in negative.EXPECTED_FLAGS_STORE.items()}
    )
    args = [str(STORE), "-p", "no:cacheprovider", "-q", "--kvfail-report", str(out)]
    args += ["--layout", "tp1", "-k", " or ".join(scenarios)]
    for reference in sorted(set(negative.STORE_REFERENCES.values())):
        args += ["--connector", reference]
    for control in sorted(negative.EXPECTED_FLAGS_STORE):
        args += ["--connector", negative.store_spec(control)]
    pytest.main(args)
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("control", sorted(negative.EXPECTED_FLAGS_STORE))
def test_reference_is_not_flagged_like_its_control(
    store_run: list[dict[str, Any]], control: str
) -> None:
    reference = negative.STORE_REFERENCES[control]
    mine = [r for r in store_run if r["connector"] == reference]
    problems = negative.reference_problems(mine, negative.EXPECTED_FLAGS_STORE[control])
    assert not problems, f"{reference}: " + "; ".join(problems)


@pytest.mark.parametrize("control", sorted(negative.EXPECTED_FLAGS_STORE))
def test_store_control_is_flagged(store_run: list[dict[str, Any]], control: str) -> None:
    flag = negative.EXPECTED_FLAGS_STORE[control]
    spec = negative.store_spec(control)
    runs = [r for r in store_run if r["connector"] == spec and r["scenario"] == flag.scenario]
    assert {r["policy"] for r in runs} == set(flag.policies), runs
    for r in runs:
        assert r["outcome"] == "failed", r
        assert flag.clause in r["reason"], r["reason"]
