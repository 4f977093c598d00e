"""The gate of the transport-backed test modules: an absent transport is a skip, except in
a run that requires its transports, where it is a failure (``tests/transports.py``)."""

from __future__ import annotations

import pytest

from tests import transports

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")


@pytest.fixture
def absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every transport reads as absent, with the reason its probe would give."""
    monkeypatch.setattr(transports, "_probe", lambda _t: lambda: "no such library")


def test_this_run_requires_its_transports() -> None:
    """The project's own configuration turns the gate on, so CI cannot skip a transport."""
    assert transports.REQUIRED


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_an_absent_transport_fails_where_required(
    absent: None, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setattr(transports, "REQUIRED", True)
    with pytest.raises(pytest.fail.Exception, match=f"{transport} is required.*no such library"):
        transports.require_transport(transport)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_an_absent_transport_skips_where_optional(
    absent: None, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setattr(transports, "REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match="no such library"):
        transports.require_transport(transport)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_present_transport_passes_the_gate(transport: str) -> None:
    """This machine has both transports (``scripts/setup.sh`` installs them)."""
    assert transports.require_transport(transport) is None  # type: ignore[arg-type, func-returns-value]
