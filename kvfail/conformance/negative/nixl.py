"""Negative control on NIXL pull: kvfail's NIXL connector whose fence trusts the clock.

:class:`ReleasesUnprovenNixl` is :class:`connectors.nixl.KvfailNixlConnector` with one
method broken: at the deadline its fence releases every READ of the failed load, one
still in ``PROC`` included, and gives the blocks back. Releasing a READ does not stop a
UCX GET whose reply is on its way, so a slow P's reply lands in blocks the scheduler
already gave another request: the suite must see that (``C11 wrong KV``), where the
unbroken connector holds the blocks until the READ ended. Defined only where kvfail's
NIXL connector can be imported (:data:`EXPECTED_FLAGS_REAL_NIXL` is empty otherwise).
"""

from __future__ import annotations

from typing import Any

from kvfail.conformance.negative.flag import Flag
from kvfail.conformance.negative.rebind import break_worker

__all__ = ["EXPECTED_FLAGS_REAL_NIXL"]


class _ReleasesInFlightWorker:
    """A READ counts as ended whatever NIXL says of it: one in ``PROC`` is released too."""

    def _release_if_ended(self, req_id: str, handle: Any) -> bool:
        return self._try_release_xfer_handle(req_id, handle)  # type: ignore[attr-defined,no-any-return]


try:
    from connectors.nixl import KvfailNixlConnector as _KvfailNixl
except Exception:  # NIXL or vLLM's NIXL module not importable: no control
    _KvfailNixl = None

if _KvfailNixl is not None:

    class ReleasesUnprovenNixl(_KvfailNixl):  # type: ignore[misc,valid-type]
        """KvfailNixlConnector that releases a failed load's READs in flight, and so its
        blocks, at the deadline (a D that trusts its clock instead of the transfer)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            break_worker(self, _ReleasesInFlightWorker)

    __all__ += ["ReleasesUnprovenNixl"]

#: The control, and each scenario that must flag it: the slow P whose READ answers after
#: the deadline, into blocks the scheduler reuses last-in, first-out for the requests the
#: scenario adds. The reference, kvfail's ``nixl``, passes it.
EXPECTED_FLAGS_REAL_NIXL: dict[str, tuple[Flag, ...]] = (
    {
        "ReleasesUnprovenNixl": (Flag("test_slow_peer_writes_after_deadline", "C11 wrong KV"),),
    }
    if _KvfailNixl is not None
    else {}
)
