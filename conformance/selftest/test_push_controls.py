"""Self-test of the NIXL push driver: its control is flagged where the reference passes.

``DropsPushLoadErrors`` (``kvfail.conformance.negative``) is upstream's NixlPushConnector
reporting every failed load as finished. The reference (upstream's NixlPushConnector
under the push driver, ``vllm:NixlPushConnector``) must pass the scenario that flags it,
or the flag is no evidence. One inner session, one policy: each push D costs a real NIXL
handshake with a real P process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import kvfail.conformance.negative as negative
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

if not negative.EXPECTED_FLAGS_PUSH:
    pytest.skip("NIXL's push connector cannot be imported here", allow_module_level=True)

import kvfail.conformance.nixl_push_driver  # noqa: F401 - loaded before the inner session

POLICY = "fail"


@pytest.fixture(scope="module")
def push_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("kvfail-push-report")
    scenarios = sorted({f.scenario for f in negative.EXPECTED_FLAGS_PUSH.values()})
    args = [str(SCENARIOS / "test_scenarios.py"), "-p", "no:cacheprovider", "-q"]
    args += ["--kvfail-report", str(out), "--layout", "tp1", "--policy", POLICY]
    args += ["-k", " or ".join(scenarios), "--connector", negative.PUSH_REFERENCE]
    for control in sorted(negative.EXPECTED_FLAGS_PUSH):
        args += ["--connector", f"kvfail.conformance.negative:{control}"]
    pytest.main(args)
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("control", sorted(negative.EXPECTED_FLAGS_PUSH))
def test_reference_passes_what_flags_the_control(
    push_run: list[dict[str, Any]], control: str
) -> None:
    scenario = negative.EXPECTED_FLAGS_PUSH[control].scenario
    mine = [
        r
        for r in push_run
        if r["connector"] == negative.PUSH_REFERENCE and r["scenario"] == scenario
    ]
    assert mine, f"the reference did not run {scenario}"
    assert all(r["outcome"] == "passed" for r in mine), mine


@pytest.mark.parametrize("control", sorted(negative.EXPECTED_FLAGS_PUSH))
def test_push_control_is_flagged(push_run: list[dict[str, Any]], control: str) -> None:
    flag = negative.EXPECTED_FLAGS_PUSH[control]
    spec = f"kvfail.conformance.negative:{control}"
    runs = [r for r in push_run if r["connector"] == spec and r["scenario"] == flag.scenario]
    assert runs, f"{control} did not run {flag.scenario}"
    for r in runs:
        assert r["policy"] == POLICY
        assert r["outcome"] == "failed", r
        assert flag.clause in r["reason"], r["reason"]
