"""Smoke run of ``bench.pd_overhead --quick``: real P and Ds, every arm, both transports.

Marked ``e2e_bench`` only, not ``e2e``: CI's ``pytest e2e -m e2e`` keeps its time, and the
default run never collects ``e2e/``. Run it with ``.venv/bin/python -m pytest e2e -m
e2e_bench``. It checks that the bench runs end to end (every request of every round
answered in full with KV from P: the bench stops otherwise) and prints its figures; the
figures themselves are timings and are never asserted.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.servers import missing_serve_modules

pytestmark = [pytest.mark.e2e_bench, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
FIGURES = [
    f"pd_{arm}{kind}_{transport}"
    for arm in ("", "guard_")
    for kind in ("tps_ratio", "ttft_p50_ratio", "ttft_p99_ratio", "tps_ratio_spread")
    for transport in ("mooncake", "nixl")
]


def test_pd_overhead_quick_run_completes() -> None:
    missing = missing_serve_modules()
    if missing:
        pytest.skip(f"vllm serve cannot import {missing}: run scripts/setup.sh")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pd_overhead", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    print(proc.stdout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    values = dict(pair.split("=", 1) for pair in last.split())
    assert sorted(values) == sorted(FIGURES)
    assert all(math.isfinite(float(v)) and float(v) >= 0 for v in values.values())
