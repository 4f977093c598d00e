"""The worker half of the block quarantine: which delivered loads' blocks are still held.

Apart from :mod:`kvfail.tracker` because holding is bookkeeping after delivery: a load
that failed while its transfer may still write is delivered at once, and from then on
only this part knows it, until the write is fenced. Each step it names the loads it began
and stopped holding, which the scheduler half (:mod:`kvfail.quarantine`) applies to the
block pool.

:class:`TrackerQuarantine` is a mixin of :class:`kvfail.tracker.LoadTracker`: it works on
the tracker's own state, under the tracker's one lock, and holds no state of its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvfail.deferred_log import PendingLog
from kvfail.load_records import Load

if TYPE_CHECKING:
    from kvfail.tracker import LoadTracker


class TrackerQuarantine:
    """Held loads of :class:`kvfail.tracker.LoadTracker`, and the notices about them."""

    def fenced(self: LoadTracker, req_id: str) -> bool:
        """The transfer of ``req_id`` can no longer write (it completed, its peer is
        dead, or the peer's own expiry passed): a quarantined load's blocks go back to
        the scheduler at the next step, a load not yet delivered is no longer unfenced.
        Returns False (and counts it) for an id in neither state."""
        log = PendingLog()
        try:
            with self._lock:
                held = self._quarantined.get(req_id)
                if held is not None:
                    self._release_locked(held, log)
                    return True
                load = self._loads.get(req_id)
                if load is not None:
                    load.unfenced = False
                    return True
                self._refuse_locked(req_id, "fenced", log)
                return False
        finally:
            log.flush()

    def is_quarantined(self: LoadTracker, req_id: str) -> bool:
        return req_id in self._quarantined

    @property
    def quarantined_blocks(self: LoadTracker) -> int:
        """Blocks of delivered loads still held for their transfer (this worker's view)."""
        with self._lock:
            return sum(len(load.flat) for load in self._quarantined.values())

    def take_quarantine_notice(self: LoadTracker) -> tuple[frozenset[str], frozenset[str]]:
        """(held, released) request ids since the last call: what the scheduler side
        must apply (:class:`kvfail.quarantine.BlockQuarantine`) with this step's
        report. Take it after :meth:`drain`, in the same step."""
        if not (self._notice_held or self._notice_released):
            return frozenset(), frozenset()
        with self._lock:
            held, released = frozenset(self._notice_held), frozenset(self._notice_released)
            self._notice_held.clear()
            self._notice_released.clear()
        return held, released

    def _hold_locked(self: LoadTracker, load: Load) -> None:
        """``load`` is being delivered unfenced: keep its blocks until the write is over."""
        self._quarantined[load.req_id] = load
        self._notice_held.add(load.req_id)
        self._stats.event("loads_quarantined")

    def _release_locked(self: LoadTracker, load: Load, log: PendingLog) -> None:
        del self._quarantined[load.req_id]
        self._notice_released.add(load.req_id)
        self._stats.event("quarantine_released")
        self._note_load(
            log,
            logging.INFO,
            "kvfail: quarantined load fenced; its blocks go back",
            load,
            blocks=len(load.flat),
        )
