"""A conformance run keeps its report whatever ends it: an INTERNALERROR inside pytest,
Ctrl-C or SIGTERM. Each case runs a real ``python -m pytest`` in a child process with the
toy connector: one scenario passes, the next ends the run its way, and ``report.json`` /
``report.md`` must hold the scenario that finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

ROOT = Path(__file__).resolve().parents[2]

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
    "sigint": ("False", "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)"),
    "sigterm": ("False", "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_report_survives_the_runs_end(tmp_path: Path, ending: str) -> None:
    internal, body = ENDINGS[ending]
    (tmp_path / "conftest.py").write_text(CONFTEST.format(internal=internal))
    (tmp_path / "test_ends.py").write_text(SCENARIOS.format(ending=body))
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_ends.py"),
            *("--connector", "toy", "--policy", "fail", "--layout", "tp1"),
            *("--kvfail-report", str(out)),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    if ending == "internalerror":
        assert "INTERNALERROR" in log and done.returncode == pytest.ExitCode.INTERNAL_ERROR, log
    records = json.loads((out / "report.json").read_text())
    outcomes = {r["scenario"]: r["outcome"] for r in records}
    assert outcomes.get("test_a") == "passed", (outcomes, log)
    assert "test_a" in (out / "report.md").read_text()
    assert not list(out.glob(".report.*")), "a temporary file was left behind"
