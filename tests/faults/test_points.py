"""The fault-point vocabulary is complete, consistent, and free of vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvfail.faults import (
    CLAUSE_TITLES,
    FAULT_SPECS,
    Clause,
    Detection,
    FaultPoint,
    points_for,
)


def test_every_point_has_a_spec_with_clauses() -> None:
    assert set(FAULT_SPECS) == set(FaultPoint)
    for point in FaultPoint:
        assert point.description
        assert point.clauses, point
        assert point.active != point.silent
    assert set(CLAUSE_TITLES) == set(Clause)


def test_silent_points_are_the_deadline_cases() -> None:
    silent = set(points_for(detection=Detection.SILENT))
    assert {FaultPoint.FREEZE_PEER, FaultPoint.NET_BLACKHOLE} <= silent
    assert FaultPoint.REFUSE not in silent
    assert all(Clause.C10 in p.clauses for p in silent)


def test_points_for_filters_in_declaration_order() -> None:
    c9 = points_for(Clause.C9)
    assert c9 == (FaultPoint.ABORT_WHILE_WAITING,)
    everything = points_for()
    assert everything == tuple(FaultPoint)
    assert FaultPoint("net_blackhole") is FaultPoint.NET_BLACKHOLE  # stable report ids


def test_faults_package_does_not_import_vllm() -> None:
    code = "import sys, kvfail.faults; sys.exit('vllm' in sys.modules or 'torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
