"""The suite under pytest-xdist: a run split over two workers writes one report, from
the controller, and its coverage gate judges the merged set of scenarios.

A real ``python -m pytest -n 2`` in a child process (the controller and its workers are
processes of their own). ``--dist load`` spreads one connector's scenarios over both
workers, the hardest case for the merge: a clause one worker verified and the other did
not must count as verified, and a clause no worker verified must fail the run although
every scenario passed or skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfail.rig.contention import MAX_FACTOR
from tests.child_pytest import run_child_pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
pytest.importorskip("xdist", reason="pytest-xdist is not installed")

CONFTEST = """
from kvfail.conformance.plugin import fallback_plugins

pytest_plugins = fallback_plugins()
"""

SCENARIOS = """
import pytest

from kvfail.conformance.suite import SuiteSkip


@pytest.mark.clauses("C1", "C7")
def test_builds(scenario):
    scenario.engine()


@pytest.mark.clauses("C1", "C9")
def test_unjudged(scenario):
    # A skip that excuses nothing: the clauses it cites are judged only elsewhere.
    raise SuiteSkip("driver unavailable: none here", ("driver",))
"""


#: Three processes import vLLM at once here: on a loaded 2-core machine that alone took
#: minutes, so the bound is generous (a hang still ends).
CHILD_TIMEOUT_S = 540


@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)
def test_two_workers_write_one_report_and_gate_the_merged_set(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_split.py").write_text(SCENARIOS)
    out = tmp_path / "report"
    rc, log = run_child_pytest(
        [
            "test_split.py",
            *("-n", "2", "--dist", "load"),
            *("--connector", "toy", "--policy", "both", "--layout", "tp1"),
            *("--kvfail-report", str(out)),
        ],
        tmp_path,
        CHILD_TIMEOUT_S,
    )
    assert "bringing up nodes" in log, log  # xdist ran the session
    records = json.loads((out / "report.json").read_text())
    got = sorted((r["scenario"], r["policy"], r["outcome"]) for r in records)
    assert got == [
        ("test_builds", "fail", "passed"),
        ("test_builds", "recompute", "passed"),
        ("test_unjudged", "fail", "skipped"),
        ("test_unjudged", "recompute", "skipped"),
    ], log
    assert all("@" not in r["nodeid"] for r in records), records
    # Each scenario that ran says by how much the machine stretched its waits.
    ran = [r for r in records if r["outcome"] == "passed"]
    assert all(1.0 <= r["details"]["time_scale"] <= MAX_FACTOR for r in ran), ran
    assert len((out / "records.jsonl").read_text().splitlines()) == len(records)
    coverage = json.loads((out / "coverage.json").read_text())
    assert coverage["verdicts"]["toy"] == {"C1": "verified", "C7": "verified", "C9": "unverified"}
    assert [line.split(":")[0] for line in coverage["unverified"]] == ["C9 unverified for toy"]
    # Every scenario passed or skipped: only the controller's gate fails the run.
    assert rc == pytest.ExitCode.TESTS_FAILED, log
    assert "C9 unverified for toy" in log and "kvfail conformance: toy" in log
    assert json.loads((out / "capabilities.json").read_text())["toy"]["driver"] == "toy"
