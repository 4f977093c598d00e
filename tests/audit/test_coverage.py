"""The coverage gate: every connector in vLLM's registry has a driver, or its source says
it never loads external KV or cannot run here (issue #14).

Static only (source read by AST; no vLLM import, no engine), so it runs in the default
test run. Like vLLM's own conformance tiers, a registered connector nobody accounted for
fails the run, by name.
"""

from __future__ import annotations

import linecache
from pathlib import Path

import pytest

from kvfail.audit import coverage
from kvfail.audit.applicability import BLOCKED, NOT_APPLICABLE, Assessor
from kvfail.audit.source import SourceIndex, find_module_file

ROOT = Path(__file__).resolve().parents[2]
FIX = "tests.audit.fixtures.coverage"
needs_vllm_source = pytest.mark.skipif(
    find_module_file("vllm.distributed.kv_transfer.kv_connector.factory") is None,
    reason="vLLM is not installed",
)


@pytest.fixture(autouse=True)
def _repo_first_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve ``tests.audit...`` to this checkout, not another ``tests`` package."""
    monkeypatch.syspath_prepend(str(ROOT))


def _fixture_verdicts(*classes: str, pending: dict[str, str] | None = None) -> dict:
    entries = [(c, FIX, c) for c in classes]
    found = coverage.check_registry(entries, pending=pending or {}, entry_points=set())
    return {v.name: v for v in found}


def _assert_evidence_is_the_source(verdict: coverage.Verdict) -> None:
    """Every evidence line is what the file holds at that line (read, not remembered)."""
    assert verdict.applicability is not None and verdict.applicability.evidence
    for ev in verdict.applicability.evidence:
        assert linecache.getline(ev.path, ev.line).strip() == ev.text


@needs_vllm_source
def test_every_registered_connector_is_covered() -> None:
    verdicts = coverage.check_registry()
    assert len(verdicts) >= 17  # the registry was read, not skipped
    assert coverage.gate_failures(verdicts) == []
    by = {v.name: v for v in verdicts}
    for v in by.values():
        if v.kind in (NOT_APPLICABLE, BLOCKED):
            _assert_evidence_is_the_source(v)


def test_gate_names_a_connector_with_no_driver_and_no_reason() -> None:
    by = _fixture_verdicts("SocketLoaderConnector")
    failures = coverage.gate_failures(list(by.values()))
    assert len(failures) == 1
    assert failures[0].startswith("SocketLoaderConnector: uncovered")


def test_never_loads_and_blocked_reasons_come_from_the_source() -> None:
    by = _fixture_verdicts(
        "StoreOnlyConnector",
        "FillsDummyConnector",
        "CudaStreamConnector",
        "MissingPackageConnector",
    )
    assert coverage.gate_failures(list(by.values())) == []
    assert by["StoreOnlyConnector"].kind == NOT_APPLICABLE
    assert by["FillsDummyConnector"].kind == NOT_APPLICABLE
    assert "generated values" in by["FillsDummyConnector"].reason
    assert by["CudaStreamConnector"].kind == BLOCKED
    assert "CUDA streams" in by["CudaStreamConnector"].reason
    assert by["MissingPackageConnector"].kind == BLOCKED
    assert "'kvfail_no_such_package' is not installed" in by["MissingPackageConnector"].reason
    for v in by.values():
        _assert_evidence_is_the_source(v)
    texts = [e.text for e in by["CudaStreamConnector"].applicability.evidence]  # type: ignore[union-attr]
    assert texts == ["self.stream = torch.cuda.Stream()"]


def test_pending_entry_is_accepted_only_while_it_is_true() -> None:
    pending = {"SocketLoaderConnector": "driver not built yet", "StoreOnlyConnector": "x"}
    by = _fixture_verdicts("SocketLoaderConnector", "StoreOnlyConnector", pending=pending)
    assert by["SocketLoaderConnector"].kind == "pending"
    # A pending entry whose source now says "never loads" is stale: the list must shrink.
    assert by["StoreOnlyConnector"].kind == "stale"
    (failure,) = coverage.gate_failures(list(by.values()))
    assert failure.startswith("StoreOnlyConnector: stale: listed as pending but ")


def test_driven_classes_are_the_drivers_builtin_names() -> None:
    from kvfail.conformance.resolve import registered

    assert set(coverage.DRIVEN_CLASSES) <= set(registered())


def test_assessor_needs_no_class() -> None:
    assert Assessor(SourceIndex())(None) is None
