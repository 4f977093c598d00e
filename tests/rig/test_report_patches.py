"""The conformance plugin lists the rig patches a run applied, from every process.

A scenario whose ``scenario`` fixture records one patch itself and has a child process
record another (as a P or a TP rank process would) runs in a real pytest session; its
terminal summary, ``report.json`` and ``rig_patches.json`` must all name both. The
session resolves the toy driver, which imports vLLM, so it runs in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCENARIO = """
import subprocess, sys

import pytest

from kvfail.rig import patches as rig_patches

CHILD = "from kvfail.rig import patches; patches.record('nixl_progress_delay', '100 us')"


@pytest.fixture
def scenario(kvfail_connector, kvfail_policy, kvfail_layout):
    rig_patches.record("cpu_accelerator_index", "answered 0 1x")
    subprocess.run([sys.executable, "-c", CHILD], check=True, timeout=120)


def test_patched(scenario):
    pass
"""


def test_terminal_summary_and_report_name_every_patch(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not importable in this environment")
    (tmp_path / "test_patched_here.py").write_text(SCENARIO)
    out = tmp_path / "out"
    args = ["--connector", "toy", "--policy", "fail", "--layout", "tp1", "--kvfail-report", out]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_patched_here.py",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.split("kvfail rig patches", 1)[1]
    assert "cpu_accelerator_index: torch.accelerator.current_device_index" in summary
    assert "nixl_progress_delay: " in summary
    assert "2 process(es)" not in summary  # each patch came from one process
    records = json.loads((out / "report.json").read_text())
    assert [r["rig_patches"] for r in records] == [["nixl_progress_delay", "cpu_accelerator_index"]]
    listed = {p["name"]: p for p in json.loads((out / "rig_patches.json").read_text())}
    assert set(listed) == {"nixl_progress_delay", "cpu_accelerator_index"}
    assert listed["cpu_accelerator_index"]["connectors"] == ["toy"]
    assert listed["nixl_progress_delay"]["processes"] == 1
    assert "## Rig patches" in (out / "report.md").read_text()
