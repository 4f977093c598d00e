"""Self-test of the guard's verdicts: a broken guard must be FLAGGED over real Mooncake,
where the working guard passes the same scenario.

Why: ``--connector guard:X`` turns X's failures into passes only if the suite would see
a guard that breaks its promises. Each control in :mod:`kvfail.conformance.guard_negative`
is the guard with one method changed; one inner session runs the working guard and both
controls around upstream's ``MooncakeConnector`` (real P process, real TCP transport) over
the scenarios built to flag them, and its ``report.json`` is read here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.guard_negative import EXPECTED_GUARD_FLAGS, GUARD_INNER
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS
from tests.keyword_selection import each_control_only_its_own

GUARD = "guard:vllm:MooncakeConnector"
CONTROLS = sorted(EXPECTED_GUARD_FLAGS)
SCENARIO_NAMES = sorted({s for flags in EXPECTED_GUARD_FLAGS.values() for s, _ in flags})
#: The working guard over every scenario, each control over only those named for it.
_K = each_control_only_its_own(
    SCENARIO_NAMES, {c: [s for s, _ in flags] for c, flags in EXPECTED_GUARD_FLAGS.items()}
)


def _spec(control: str) -> str:
    return f"kvfail.conformance.guard_negative:{control}?inner={GUARD_INNER}"


@pytest.fixture(scope="module")
def guard_run(vllm_loaded: None, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from kvfail.peers.mooncake import mooncake_available

    why = mooncake_available()
    if why is not None:
        pytest.skip(f"real Mooncake cannot run here: {why}")
    out = tmp_path_factory.mktemp("kvfail-guard-report")
    args = [str(SCENARIOS / "test_scenarios.py"), str(SCENARIOS / "test_quarantine.py")]
    args += ["-p", "no:cacheprovider", "-q", "--layout", "tp1", "--policy", "recompute"]
    args += ["--kvfail-report", str(out), "-k", _K]
    for spec in [GUARD, *(_spec(c) for c in CONTROLS)]:
        args += ["--connector", spec]
    pytest.main(args)
    records: list[Any] = json.loads((out / "report.json").read_text())
    return records


def _runs(records: list[Any], connector: str, scenario: str) -> list[tuple[str, str]]:
    return [
        (r["outcome"], str(r.get("reason", ""))[:2000])
        for r in records
        if r["connector"] == connector and r["scenario"] == scenario
    ]


def test_working_guard_passes_what_the_controls_break(guard_run: list[Any]) -> None:
    for scenario in SCENARIO_NAMES:
        runs = _runs(guard_run, GUARD, scenario)
        assert runs and {outcome for outcome, _ in runs} == {"passed"}, (scenario, runs)


@pytest.mark.parametrize(
    ("control", "scenario", "clause"),
    [(c, s, clause) for c in CONTROLS for s, clause in EXPECTED_GUARD_FLAGS[c]],
)
def test_broken_guard_is_flagged_by_its_scenario(
    guard_run: list[Any], control: str, scenario: str, clause: str
) -> None:
    runs = _runs(guard_run, _spec(control), scenario)
    assert runs, f"{control} never ran {scenario}"
    ran = {r["scenario"] for r in guard_run if r["connector"] == _spec(control)}
    assert ran == {s for s, _ in EXPECTED_GUARD_FLAGS[control]}, ran
    assert all(outcome == "failed" and clause in reason for outcome, reason in runs), runs


def test_controls_run_the_inner_connectors_own_driver() -> None:
    from kvfail.conformance.guard_driver import GuardDriver
    from kvfail.conformance.mooncake_driver import MooncakeDriver
    from kvfail.conformance.resolve import resolve

    for control in CONTROLS:
        driver = resolve(_spec(control))
        assert isinstance(driver, GuardDriver), control
        assert isinstance(driver.inner, MooncakeDriver), control
        assert driver.connector_cls.__name__ == control
