"""Self-test of the one-rank scenarios: their controls are flagged at TP 2, where the toy passes.

A fault on one TP rank runs for each rank in turn (``test_tp2_failure_on_one_rank_<r>``)
and under many loads (``test_many_loads_one_rank_killed``, and ``_frozen``, where only
D's deadline ends the stopped rank's share). ``FailsOnlyOnRankZero``
(``kvfail.conformance.negative``) reports failures from rank 0 only: the rank 0 scenario
and every TP 1 scenario pass it, so only the rank 1 faults can show it, and
``ReportsOneFailurePerStep`` must be caught where many loads fail on one rank too
(:data:`~kvfail.conformance.negative.EXPECTED_FLAGS_TP2`). One inner session in the
``tp2`` layout, on the toy (the harness simulates the two ranks in this process), both
policies: the healthy toy must pass every selected scenario, or a flag is no evidence.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import kvfail.conformance.negative as negative
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

REFERENCE = "toy"
CONTROLS = sorted(negative.EXPECTED_FLAGS_TP2)
#: Every scenario a TP 2 control is flagged by or must still pass.
SELECTED = sorted(
    {f.scenario for flags in negative.EXPECTED_FLAGS_TP2.values() for f in flags}
    | {s for passes in negative.PASSES_TP2.values() for s in passes}
)


@pytest.fixture(scope="module")
def tp2_run(vllm_loaded: None, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("kvfail-tp2-report")
    args = [str(SCENARIOS / "test_scenarios.py"), str(SCENARIOS / "test_concurrency.py")]
    args += ["-p", "no:cacheprovider", "-q", "--kvfail-report", str(out), "--layout", "tp2"]
    args += ["-k", " or ".join(SELECTED), "--connector", REFERENCE]
    for control in CONTROLS:
        args += ["--connector", f"kvfail.conformance.negative:{control}"]
    pytest.main(args)
    return json.loads((out / "report.json").read_text())


def _runs(run: list[dict[str, Any]], connector: str, scenario: str) -> list[dict[str, Any]]:
    return [r for r in run if r["connector"] == connector and r["scenario"] == scenario]


@pytest.mark.parametrize("scenario", SELECTED)
def test_toy_passes_the_tp2_scenario(tp2_run: list[dict[str, Any]], scenario: str) -> None:
    runs = _runs(tp2_run, REFERENCE, scenario)
    assert {r["policy"] for r in runs} == {"fail", "recompute"}, runs
    assert all(r["outcome"] == "passed" for r in runs), runs


@pytest.mark.parametrize(
    ("control", "flag"),
    [(c, f) for c, flags in sorted(negative.EXPECTED_FLAGS_TP2.items()) for f in flags],
    ids=lambda v: v if isinstance(v, str) else v.scenario,
)
def test_tp2_control_is_flagged(
    tp2_run: list[dict[str, Any]], control: str, flag: negative.Flag
) -> None:
    runs = _runs(tp2_run, f"kvfail.conformance.negative:{control}", flag.scenario)
    assert {r["policy"] for r in runs} == flag.policies, runs
    for r in runs:
        assert negative.flags(r, flag), (flag.clause, r["outcome"], r["reason"])


@pytest.mark.parametrize(
    ("control", "scenario"),
    [(c, s) for c, passes in sorted(negative.PASSES_TP2.items()) for s in passes],
)
def test_tp2_control_passes_the_rest(
    tp2_run: list[dict[str, Any]], control: str, scenario: str
) -> None:
    """Broken in ONE way: a fault on rank 0 and the basics show nothing."""
    runs = _runs(tp2_run, f"kvfail.conformance.negative:{control}", scenario)
    assert runs and all(r["outcome"] == "passed" for r in runs), runs
