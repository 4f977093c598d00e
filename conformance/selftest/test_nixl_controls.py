"""Self-test of the NIXL pull driver's late-write check: its control is flagged where the
reference passes.

``ReleasesUnprovenNixl`` (``kvfail.conformance.negative``) is kvfail's NIXL connector
with a fence that releases a READ still in flight at the deadline. A slow P's READ then
lands in blocks the scheduler gave another request. The reference (kvfail's ``nixl``)
must pass the same scenario, or the flag is no evidence. One inner session, one policy:
the verdict is the connector's hold on blocks, which no policy changes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import kvfail.conformance.negative as negative
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

if not negative.EXPECTED_FLAGS_REAL_NIXL:
    pytest.skip("kvfail's NIXL connector cannot be imported here", allow_module_level=True)

REFERENCE = "nixl"
POLICY = "fail"
CONTROLS = sorted(negative.EXPECTED_FLAGS_REAL_NIXL)
FLAGS = [f for flags in negative.EXPECTED_FLAGS_REAL_NIXL.values() for f in flags]


@pytest.fixture(scope="module")
def nixl_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("kvfail-nixl-report")
    scenarios = sorted({f.scenario for f in FLAGS})
    args = [str(SCENARIOS / "test_quarantine.py"), "-p", "no:cacheprovider", "-q"]
    args += ["--kvfail-report", str(out), "--layout", "tp1", "--policy", POLICY]
    args += ["-k", " or ".join(scenarios), "--connector", REFERENCE]
    for control in CONTROLS:
        args += ["--connector", f"kvfail.conformance.negative:{control}"]
    pytest.main(args)
    return json.loads((out / "report.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.scenario)
def test_reference_is_ground_for_the_flag(nixl_run: list[dict[str, Any]], flag: Any) -> None:
    mine = [r for r in nixl_run if r["connector"] == REFERENCE]
    assert negative.reference_problems(mine, flag) == []


@pytest.mark.parametrize("control", CONTROLS)
def test_nixl_control_is_flagged_by_every_scenario_named(
    nixl_run: list[dict[str, Any]], control: str
) -> None:
    spec = f"kvfail.conformance.negative:{control}"
    for flag in negative.EXPECTED_FLAGS_REAL_NIXL[control]:
        runs = [r for r in nixl_run if r["connector"] == spec and r["scenario"] == flag.scenario]
        assert len(runs) == 1, f"{control} ran {flag.scenario} {len(runs)} times"
        assert negative.flags(runs[0], flag), runs[0]["reason"]
