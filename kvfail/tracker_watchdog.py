"""The load tracker's deadlines: the heap that orders them, and the watchdog the drain runs.

Apart from :mod:`kvfail.tracker` because ending a load nobody answered for is its own job:
the heap is lazy (a delivered load leaves its entry behind), so it needs compacting, and an
overdue load may be delivered only once the connector's fence says its transfer can no
longer write, which means calling connector code and retrying it at later drains.

:class:`TrackerWatchdog` is a mixin of :class:`kvfail.tracker.LoadTracker`: it works on the
tracker's own state, under the tracker's one lock, and holds no state of its own.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING, Final

from kvfail.deferred_log import PendingLog
from kvfail.load_records import ALL_PEERS, Load
from kvfail.stages import Stage

if TYPE_CHECKING:
    from kvfail.tracker import LoadTracker

logger = logging.getLogger("kvfail")

#: Stale entries the deadline heap may hold beyond twice the in-flight loads before it is
#: compacted (delivered loads leave their entry behind; popping them is lazy).
DEADLINE_HEAP_SLACK: Final = 64


class TrackerWatchdog:
    """Deadlines of :class:`kvfail.tracker.LoadTracker`: overdue loads fail at the drain."""

    def _push_deadline_locked(self: LoadTracker, at: float, load: Load) -> None:
        # The sequence number breaks ties, so two loads due at once never compare.
        heapq.heappush(self._deadlines, (at, next(self._seq), load))

    def _run_watchdog(self: LoadTracker, log: PendingLog) -> None:
        now = self._clock()
        overdue: list[Load] = []
        held: list[Load] = []  # quarantined loads whose fence is due a retry
        with self._lock:
            heap, loads = self._deadlines, self._loads
            while heap and heap[0][0] <= now:
                deadline, _, load = heapq.heappop(heap)
                if self._quarantined.get(load.req_id) is load:
                    held.append(load)
                    continue
                if loads.get(load.req_id) is not load or load.settled:
                    continue  # delivered or re-tracked since; a stale heap entry
                # Unsettled: some peer is silent, and may have written none of the blocks.
                load.all_blocks_failed = True
                if load.failure is None:
                    self._fail_locked(
                        load,
                        Stage.WATCHDOG,
                        f"no result within {deadline - load.started:.3f}s",
                        None,
                        log,
                    )
                if not load.notify_only:  # counted as what is reported: nothing, for those
                    self._stats.event("watchdog_fired")
                overdue.append(load)
        if not (overdue or held):
            return
        # The fence runs outside our lock: it is connector code and may call back into us.
        fence = self._fence
        fenced = {load for load in (*overdue, *held) if fence is None or self._try_fence(load)}
        with self._lock:
            for load in held:
                if self._quarantined.get(load.req_id) is not load:
                    continue  # fenced() released it meanwhile
                if load in fenced:
                    self._release_locked(load, log)
                else:
                    self._push_deadline_locked(now + self._fence_retry_s, load)
            for load in overdue:
                if load.settled or self._loads.get(load.req_id) is not load:
                    continue
                if load in fenced:  # the fence holds now, whatever a report said before
                    load.unfenced = False
                    self._settle_locked(load, ALL_PEERS, log)
                elif self.quarantine:
                    # Fail fast, free safely: delivered now, its blocks held until the
                    # fence holds (retried at later drains) or fenced() is called.
                    load.unfenced = True
                    self._settle_locked(load, ALL_PEERS, log)
                    self._push_deadline_locked(now + self._fence_retry_s, load)
                else:
                    # A transfer that may still write into these blocks must not be
                    # delivered (C11); try again at a later drain.
                    self._stats.event("fence_deferred")
                    self._push_deadline_locked(now + self._fence_retry_s, load)

    def _try_fence(self: LoadTracker, load: Load) -> bool:
        assert self._fence is not None
        try:
            return bool(self._fence(load.req_id))
        except Exception:
            logger.exception("kvfail: fence raised for req_id=%r; retrying later", load.req_id)
            return False

    def _compact_deadlines_locked(self: LoadTracker) -> None:
        """Drop stale heap entries once they outnumber the live ones (amortised O(1)).

        Called wherever a load is added or leaves, so the heap stays within twice the
        in-flight loads plus a constant, for every way a load can leave.
        """
        loads, held = self._loads, self._quarantined
        if len(self._deadlines) <= 2 * (len(loads) + len(held)) + self._heap_slack:
            return
        live = [
            e
            for e in self._deadlines
            if (loads.get(e[2].req_id) is e[2] and not e[2].settled)
            or held.get(e[2].req_id) is e[2]  # a quarantined load's fence retry
        ]
        heapq.heapify(live)
        self._deadlines = live
