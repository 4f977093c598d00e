"""A conformance run keeps its report whatever ends it: an INTERNALERROR inside pytest,
Ctrl-C or SIGTERM. Each case runs a real ``python -m pytest`` in a child process with the
toy connector: one scenario passes, the next ends the run its way, and ``report.json`` /
``report.md`` must hold the scenario that finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.child_pytest import run_child_pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")


CONFTEST = """
from kvfail.conformance.plugin import fallback_plugins

pytest_plugins = fallback_plugins()


def pytest_runtest_logreport(report):
    # What pytest met while rendering a failure in a long run: an error of its own.
    if "test_b" in report.nodeid and report.when == "call" and {internal}:
        raise SystemError("AST constructor recursion depth mismatch (before=90, after=65)")
"""

SCENARIOS = """
import os
import signal
import time

import pytest


@pytest.mark.clauses("C7")
def test_a(kvfail):
    kvfail.engine()


def test_b(kvfail):
    {ending}
"""

ENDINGS = {
    "internalerror": ("True", "assert False, 'a failure pytest must render'"),
    # Python keeps SIGINT ignored when its parent did (a run started in the background):
    # Ctrl-C's default handler first, as a terminal's run has it.
    "sigint": (
        "False",
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)",
    ),
    "sigterm": ("False", "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_report_survives_the_runs_end(tmp_path: Path, ending: str) -> None:
    internal, body = ENDINGS[ending]
    (tmp_path / "conftest.py").write_text(CONFTEST.format(internal=internal))
    (tmp_path / "test_ends.py").write_text(SCENARIOS.format(ending=body))
    out = tmp_path / "report"
    rc, log = run_child_pytest(
        [
            "test_ends.py",
            *("--connector", "toy", "--policy", "fail", "--layout", "tp1"),
            *("--kvfail-report", str(out)),
        ],
        tmp_path,
        300,
    )
    assert rc != 0, log
    if ending == "internalerror":
        assert "INTERNALERROR" in log and rc == pytest.ExitCode.INTERNAL_ERROR, log
    records = json.loads((out / "report.json").read_text())
    outcomes = {r["scenario"]: r["outcome"] for r in records}
    assert outcomes.get("test_a") == "passed", (outcomes, log)
    assert "test_a" in (out / "report.md").read_text()
    assert not list(out.glob(".report.*")), "a temporary file was left behind"
