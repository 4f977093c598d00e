"""The load tracker: per-request, sticky, idempotent failure state, drained once a step.

Design notes (why it looks like this):

* One lock, short critical sections, no timer threads. Reports arrive from transport
  threads, asyncio loops and the worker thread; the drain runs on the worker thread once
  per engine step. Deadlines are checked at the drain, because the drain is the only
  moment a result can reach the scheduler anyway.
* State lives per request, not per report. A request that fails five times (several
  peers, retries, a watchdog) occupies one slot, and its slot is released at the drain
  that delivers it. Memory is bounded by in-flight loads, which the scheduler bounds.
* A request is delivered only when every peer task has settled (C11): after delivery the
  scheduler may free and reuse the blocks, so a peer still writing would corrupt another
  request. Failure and completion are delivered in the same drain (C2, C3).
* Reports for ids we do not track are counted and logged, never raised and never passed
  on (C7): the scheduler asserts on unknown ids inside the engine loop.
* The idle drain takes no lock: it checks a list and the earliest deadline.

This module holds the per-load state and the reports that change it; :class:`LoadTracker`
composes the rest as mixins over that state: the drain and its choice of channel
(:mod:`kvfail.tracker_drain`), the deadline heap and its watchdog
(:mod:`kvfail.tracker_watchdog`), and the loads held for quarantine
(:mod:`kvfail.tracker_quarantine`).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Final

from kvfail.blocks import normalise_block_ids
from kvfail.deferred_log import PendingLog
from kvfail.load_records import (
    ALL_PEERS,
    Failure,
    Load,
    as_stage,
    no_peers_problem,
    peer_set,
)
from kvfail.stages import Stage
from kvfail.stats import FailureStats, StatsRecorder
from kvfail.tracker_drain import TrackerDrain
from kvfail.tracker_quarantine import TrackerQuarantine
from kvfail.tracker_watchdog import DEADLINE_HEAP_SLACK, TrackerWatchdog

Clock = Callable[[], float]
Fence = Callable[[str], bool]


#: How many recently delivered ids are remembered, to tell a late report from an unknown
#: one in stats and logs: an id stays known as late until at least this many ids were
#: delivered (or notify-only loads settled) after it. Two generations are kept, each at
#: most this size or one drain's deliveries, so the memory does not grow with traffic.
RECENT_IDS_KEPT: Final = 4096


class LoadTracker(TrackerDrain, TrackerQuarantine, TrackerWatchdog):
    """Thread-safe registry of in-flight KV loads on the receiving side.

    Its parts share one lock and one state, so every part's state is set here; the drain
    (:class:`~kvfail.tracker_drain.TrackerDrain`), the watchdog
    (:class:`~kvfail.tracker_watchdog.TrackerWatchdog`) and the quarantine's holds
    (:class:`~kvfail.tracker_quarantine.TrackerQuarantine`) are mixins without their own.
    """

    def __init__(
        self,
        *,
        num_kv_cache_groups: int = 1,
        name: str = "connector",
        default_deadline_s: float | None = None,
        request_level_available: bool = True,
        block_level_available: bool = True,
        fence: Fence | None = None,
        fence_retry_s: float = 0.0,
        clock: Clock = time.monotonic,
        recent_ids_kept: int = RECENT_IDS_KEPT,
        quarantine: bool = False,
    ) -> None:
        """``quarantine``: the scheduler side can hold a failed load's blocks
        (:mod:`kvfail.quarantine`), so a load whose transfer may still write is failed
        at once (request-level: recompute gets fresh blocks) and its blocks are held
        until fenced. Without it, such a load is not delivered until it is fenced.

        ``request_level_available`` / ``block_level_available``: which channels reach
        the scheduler (:func:`kvfail.compat.routing` decides them for a layout)."""
        if num_kv_cache_groups < 1:
            raise ValueError(f"num_kv_cache_groups must be >= 1, got {num_kv_cache_groups}")
        if default_deadline_s is not None and not default_deadline_s > 0:
            raise ValueError(f"default_deadline_s must be > 0 or None, got {default_deadline_s}")
        if recent_ids_kept < 1:
            raise ValueError(f"recent_ids_kept must be >= 1, got {recent_ids_kept}")
        self.name = name
        self.num_kv_cache_groups = num_kv_cache_groups
        #: With several groups, block ids are only unique within a group, so a failed
        #: request can only be named by id (C5); so too where block level is gone.
        self.request_level = num_kv_cache_groups > 1 or not block_level_available
        self.request_level_available = request_level_available
        self.default_deadline_s = default_deadline_s
        self._fence = fence
        self._fence_retry_s = fence_retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._loads: dict[str, Load] = {}
        self._ready: list[Load] = []
        #: (due, tie-break, load), a lazy heap the watchdog pops at the drain.
        self._deadlines: list[tuple[float, int, Load]] = []
        self._heap_slack = DEADLINE_HEAP_SLACK
        self._seq = itertools.count()
        # Two generations of recently delivered ids, swapped in O(1), so that remembering
        # them costs one C-level set update per drain however large the burst.
        self._recent: set[str] = set()
        self._recent_old: set[str] = set()
        self._recent_kept = recent_ids_kept
        self._stats = StatsRecorder()
        self.quarantine = quarantine
        #: Delivered loads whose blocks the scheduler holds until their write is fenced.
        self._quarantined: dict[str, Load] = {}
        #: This step's quarantine notices, taken by :meth:`take_quarantine_notice`.
        self._notice_held: set[str] = set()
        self._notice_released: set[str] = set()

    # ------------------------------------------------------------------ registration

    def track(
        self,
        req_id: str,
        block_ids: object,
        *,
        peers: int | Iterable[Hashable] = 1,
        deadline_s: float | None = None,
    ) -> bool:
        """Register an incoming load. Returns False if it was refused (see logs/stats).

        ``peers`` (a count or the peer tasks' names) that is empty (``0``, ``[]``) means
        no peer will write anything: a load with blocks then fails at once (stage
        ``internal``, every block, counted in ``invalid_inputs``), since a load that
        received nothing must never be delivered as a success; a notify-only load (no
        blocks) is settled and never reported. :meth:`expect_peers` agrees.
        """
        log = PendingLog()
        try:
            with self._lock:
                return self._track_locked(req_id, block_ids, peers, deadline_s, log)
        finally:
            log.flush()

    def _track_locked(
        self,
        req_id: str,
        block_ids: object,
        peers: int | Iterable[Hashable],
        deadline_s: float | None,
        log: PendingLog,
    ) -> bool:
        if not isinstance(req_id, str) or not req_id:
            self._stats.event("invalid_inputs")
            log.add(
                logging.ERROR,
                "kvfail: refused load with a non-string request id",
                connector=self.name,
                req_id=repr(req_id),
            )
            return False
        if req_id in self._loads:
            self._stats.event("duplicate_tracks")
            log.add(
                logging.WARNING,
                "kvfail: load already tracked; keeping the first",
                connector=self.name,
                req_id=req_id,
            )
            return False
        self._recent.discard(req_id)  # a re-load after recompute starts afresh
        self._recent_old.discard(req_id)
        now = self._clock()
        blocks = normalise_block_ids(block_ids)
        pending = peer_set(peers)
        if deadline_s is None:
            deadline_s = self.default_deadline_s
        deadline = math.inf if deadline_s is None else now + float(deadline_s)
        load = Load(req_id, blocks.groups, blocks.flat, pending, now, deadline)
        # Bad ids and no valid one: the scheduler still holds blocks we cannot name.
        load.request_level_only = not blocks.flat and bool(blocks.problem)
        self._loads[req_id] = load
        self._stats.event("loads_tracked")
        problems = [blocks.problem] if blocks.problem else []
        if not pending and not load.notify_only:
            problems.append(no_peers_problem(peers))
        if problems:
            # Keep the load and fail it: raising here would lose the request for good.
            self._invalid_locked(load, "; ".join(problems), log)
        if not pending:
            self._settle_locked(load, ALL_PEERS, log)
        if deadline != math.inf and not load.settled:
            self._push_deadline_locked(deadline, load)
            self._compact_deadlines_locked()
        return True

    def expect_peers(self, req_id: str, peers: int | Iterable[Hashable]) -> bool:
        """Replace the set of peer tasks still to settle, once it is known.

        Mooncake learns how many P workers serve a request only after the bootstrap
        query; a load can be tracked with one placeholder peer and widened here. No
        peers (``0``, ``[]``) means the same as in :meth:`track`: nobody will write the
        blocks, so a load with blocks fails (every block); a notify-only one settles.
        """

        def widen(load: Load, log: PendingLog) -> None:
            load.pending = peer_set(peers)
            if not load.pending:
                if not load.notify_only:
                    self._invalid_locked(load, no_peers_problem(peers), log)
                self._settle_locked(load, ALL_PEERS, log)

        return self._on_load(req_id, "expect_peers", widen, unsettled_only=True)

    # ------------------------------------------------------------------ reports

    def succeeded(self, req_id: str, *, peer: Hashable | None = None) -> bool:
        """One peer task finished its part of the load. A prior failure stays a failure."""
        return self._on_load(
            req_id, "success", lambda load, log: self._settle_locked(load, peer, log)
        )

    def failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
        fenced: bool = True,
    ) -> bool:
        """Record a failure; sticky and idempotent. Returns False if the id is not tracked.

        ``fenced=False``: the transfer may still write into the load's blocks (a push P
        may still make, a read whose handle could not be released). With ``quarantine``
        the failure is still delivered at once, and the blocks are held until
        :meth:`fenced` says the write is over; it needs ``quarantine`` (without it,
        leave the write to the fence hook, which holds the load instead).

        ``settle`` also settles the reporting peer's task (the usual case: the task that
        saw the error is done). ``peer=ALL_PEERS`` settles every task, for failures that
        happen before any peer task exists (bootstrap, bad params).

        ``block_ids`` narrows what *this report* claims to the blocks that really failed,
        so ``recompute`` can keep a valid prefix; by default it claims every block. The
        delivered failure is the union of every report's claim, plus every block if a
        peer is still silent at the deadline: a narrowed report never shrinks what
        another report or peer left unwritten (under ``recompute`` an under-reported
        block is served as computed). A narrowing that names no block of the load
        claims every block.
        """

        def fail(load: Load, log: PendingLog) -> None:
            self._fail_locked(load, as_stage(stage), reason, peer, log)
            if not fenced:
                if not self.quarantine:
                    raise ValueError("failed(fenced=False) needs a tracker with quarantine")
                load.unfenced = True
            if block_ids is None:
                load.all_blocks_failed = True
            else:
                self._narrow_locked(load, block_ids, log)
            if settle:
                self._settle_locked(load, peer, log)

        return self._on_load(req_id, "failure", fail)

    def _on_load(
        self,
        req_id: str,
        what: str,
        action: Callable[[Load, PendingLog], None],
        *,
        unsettled_only: bool = False,
    ) -> bool:
        """Run ``action`` on a tracked load under the lock; refuse unknown or late ids."""
        log = PendingLog()
        try:
            with self._lock:
                load = self._loads.get(req_id)
                if load is None or (unsettled_only and load.settled):
                    self._refuse_locked(req_id, what, log)
                    return False
                action(load, log)
                return True
        finally:
            log.flush()

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._loads

    def was_delivered(self, req_id: str) -> bool:
        """Whether ``req_id`` was reported recently (evidence for a stuck request)."""
        with self._lock:
            return self._delivered_locked(req_id)

    def _delivered_locked(self, req_id: str) -> bool:
        return req_id in self._recent or req_id in self._recent_old

    def failure_of(self, req_id: str) -> Failure | None:
        load = self._loads.get(req_id)
        return None if load is None else load.failure

    def __len__(self) -> int:
        return len(self._loads)

    # ------------------------------------------------------------------ stats

    def stats(self) -> FailureStats:
        with self._lock:
            return self._stats.total.copy()

    def take_interval_stats(self) -> FailureStats:
        with self._lock:
            return self._stats.take_interval()

    # ------------------------------------------------------------------ internals

    def _note_load(
        self, log: PendingLog, level: int, msg: str, load: Load, **fields: object
    ) -> None:
        """Add a log line about ``load``: every such line names the connector and the
        request first, so that one grep finds a request's whole story."""
        log.add(level, msg, connector=self.name, req_id=load.req_id, **fields)

    def _fail_locked(
        self, load: Load, stage: Stage, reason: str, peer: Hashable | None, log: PendingLog
    ) -> None:
        if load.failure is not None:
            self._stats.event("duplicate_reports")
            return
        now = self._clock()
        load.failure = Failure(stage, str(reason), peer, now)
        failure = {
            "stage": stage.value,
            "reason": str(reason),
            "peer": repr(peer) if peer is not None else "-",
        }
        if load.notify_only:
            # Kept (the connector reads it through failure_of) but never reported, so it
            # is neither counted nor logged as a failed load: stats match the reports.
            self._note_load(
                log,
                logging.WARNING,
                "kvfail: notify-only load ended in error; not reported (no blocks)",
                load,
                **failure,
            )
            return
        self._stats.failed(stage)
        self._note_load(
            log,
            logging.ERROR,
            "kvfail: load failed",
            load,
            **failure,
            blocks=len(load.flat),
            peers_pending=len(load.pending),
            age_ms=round((now - load.started) * 1e3, 1),
        )

    def _invalid_locked(self, load: Load, problem: str, log: PendingLog) -> None:
        """The connector described the load wrongly: fail every block, keep the load."""
        self._stats.event("invalid_inputs")
        load.all_blocks_failed = True
        if load.failure is None:
            self._fail_locked(load, Stage.INTERNAL, f"invalid load: {problem}", None, log)
        else:
            self._note_load(
                log,
                logging.WARNING,
                "kvfail: invalid input for an already failed load",
                load,
                problem=problem,
            )

    def _settle_locked(self, load: Load, peer: Hashable | None, log: PendingLog) -> None:
        if load.settled:
            if peer is not ALL_PEERS:
                self._stats.event("duplicate_reports")
            return
        pending = load.pending
        if peer is ALL_PEERS:
            pending.clear()
        elif peer is None:
            if pending:
                pending.pop()
        elif peer in pending:
            pending.discard(peer)
        else:
            self._stats.event("duplicate_reports")
            self._note_load(
                log,
                logging.DEBUG,
                "kvfail: peer already settled",
                load,
                peer=repr(peer),
            )
            return
        if pending:
            return
        load.settled = True
        if not load.notify_only:
            self._ready.append(load)
            return
        # Notify-only load (abort_immediately): the scheduler has already forgotten this
        # request, so reporting it in any channel would crash the engine (C7).
        del self._loads[load.req_id]
        self._remember_locked((load.req_id,))
        self._compact_deadlines_locked()
        self._stats.event("empty_loads")

    def _narrow_locked(self, load: Load, block_ids: object, log: PendingLog) -> None:
        blocks = normalise_block_ids(block_ids)
        own = set(load.flat)
        named = set(blocks.flat)
        foreign = named - own
        if blocks.problem or foreign:
            self._stats.event("invalid_inputs")
            self._note_load(
                log,
                logging.WARNING,
                "kvfail: ignoring failed block ids outside the load",
                load,
                problem=blocks.problem or f"not in this load: {sorted(foreign)[:5]}",
            )
        named &= own
        if not named:
            # Nothing usable was named, so nothing says which blocks arrived.
            load.all_blocks_failed = True
        elif load.failed_blocks is None:
            load.failed_blocks = named
        else:
            load.failed_blocks |= named

    def _refuse_locked(self, req_id: object, what: str, log: PendingLog) -> None:
        # Still held but settled (expect_peers after the last peer), or recently delivered.
        late = isinstance(req_id, str) and (req_id in self._loads or self._delivered_locked(req_id))
        self._stats.event("late_reports" if late else "unknown_reports")
        log.add(
            logging.WARNING,
            "kvfail: ignored report for a request that is no longer tracked"
            if late
            else "kvfail: ignored report for an unknown request",
            connector=self.name,
            req_id=repr(req_id),
            report=what,
        )

    def _remember_locked(self, req_ids: Collection[str]) -> None:
        """Remember delivered ids for late reports, in two bounded generations.

        The current generation is retired before it would exceed the limit, so each holds
        at most ``recent_ids_kept`` ids or one drain's deliveries, whichever is larger.
        """
        recent = self._recent
        if len(recent) + len(req_ids) > self._recent_kept:
            self._recent_old = recent
            self._recent = recent = set()
        recent.update(req_ids)
