"""The load tracker's once-a-step drain: what it delivers, and by which channel.

Apart from :mod:`kvfail.tracker` because delivery is the one place a load's outcome is
turned into what the scheduler reads (:class:`kvfail.load_records.StepReport`), and the
choice of channel (request id, block ids, or none this vLLM can carry) is made here once
per load, so no other part can route a failure differently.

:class:`TrackerDrain` is a mixin of :class:`kvfail.tracker.LoadTracker`: it works on the
tracker's own state, under the tracker's one lock, and holds no state of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kvfail.deferred_log import PendingLog
from kvfail.load_records import IDLE_REPORT, Failure, Load, StepReport

if TYPE_CHECKING:
    from kvfail.tracker import LoadTracker

#: How a failed load reaches the scheduler (see :meth:`TrackerDrain._channel`).
Channel = Literal["request", "blocks", "none"]


class TrackerDrain:
    """Delivery of :class:`kvfail.tracker.LoadTracker`'s settled loads, once per step."""

    def drain(self: LoadTracker) -> StepReport:
        """Deliver every settled load, failing overdue ones first. Call once per step."""
        if not self._ready:
            # Lock-free on purpose: most steps have nothing to deliver and nothing due.
            heap = self._deadlines
            if not heap or heap[0][0] > self._clock():
                return IDLE_REPORT
        log = PendingLog()
        try:
            if self._deadlines:
                self._run_watchdog(log)
            with self._lock:
                return self._deliver_locked()
        finally:
            log.flush()

    def _deliver_locked(self: LoadTracker) -> StepReport:
        ready, self._ready = self._ready, []
        if not ready:
            return IDLE_REPORT
        finished = {load.req_id for load in ready}
        loads = self._loads
        for req_id in finished:
            del loads[req_id]
        self._remember_locked(finished)
        self._compact_deadlines_locked()
        failed: set[str] = set()
        invalid: set[int] = set()
        unreportable: set[str] = set()
        failures: list[tuple[str, Failure]] = []
        for load in ready:
            failure = load.failure
            if failure is None:
                continue
            failures.append((load.req_id, failure))
            channel = self._channel(load)
            if channel == "request":
                failed.add(load.req_id)
            elif channel == "blocks":
                narrowed = load.failed_blocks
                if narrowed and not (load.all_blocks_failed or load.unfenced):
                    invalid.update(narrowed)
                else:
                    invalid.update(load.flat)
            else:
                unreportable.add(load.req_id)
            if load.unfenced and self.quarantine:
                self._hold_locked(load)
        if len(failures) < len(ready):
            self._stats.event("loads_succeeded", len(ready) - len(failures))
        if unreportable:
            finished -= unreportable  # never delivered as finished: see StepReport
        return StepReport(finished, failed, invalid, tuple(failures), frozenset(unreportable))

    def _channel(self: LoadTracker, load: Load) -> Channel:
        """The one per-load decision of how a failure reaches the scheduler: by request
        id (``"request"``), by block (``"blocks"``), or by neither (``"none"``)."""
        if load.unfenced and self.quarantine:
            # Request-level, so the scheduler drops everything the load computed and
            # recomputes into fresh blocks, never into the held ones (C11). Without that
            # channel every block of the load is named, and the scheduler half turns it
            # into the same (kvfail.vllm_quarantine._RecordedLoads).
            if self.request_level_available:
                return "request"
            if not self.request_level:
                return "blocks"
        elif not (self.request_level or load.request_level_only):
            return "blocks"
        return "request" if self.request_level_available else "none"
