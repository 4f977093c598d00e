"""The audit's dynamic tier is the conformance suite itself, run in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the dynamic tier drives vLLM's real Scheduler")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
def test_dynamic_tier_passes_the_toy_and_flags_a_swallowing_connector() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvfail.audit.cli",
        "--format",
        "json",
        "--no-progress",
        "--connector",
        "kvfail.harness.toy:ToyConnector",
        "--connector",
        "kvfail.conformance.negative:SwallowsFailure",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]  # the control violates a MUST clause
    rows = {r["name"]: r for r in json.loads(done.stdout)["connectors"]}
    toy = [f for f in rows["ToyConnector"]["findings"] if f["tier"] == "DYNAMIC"]
    bad = [f for f in rows["SwallowsFailure"]["findings"] if f["tier"] == "DYNAMIC"]
    assert toy and all(f["status"] in ("pass", "n/a") for f in toy)
    failed = {f["check"] for f in bad if f["status"] == "fail"}
    assert "dyn:test_failed_load_one_group" in failed
    reason = next(f["summary"] for f in bad if f["check"] == "dyn:test_failed_load_one_group")
    assert "C2" in reason or "liveness" in reason
