"""The write fence of kvfail's Mooncake worker: whether P can still write into a failed
load's blocks, and so how long those blocks stay held.

Why apart: Mooncake is P-push, and D holds no handle that could stop P's write. Every
rule that lets a failed or overdue load's blocks go back (the watchdog's fence, a load
failed unfenced while P may still push, the operator's ``kvfail_max_hold_s``, the
bookkeeping of holds that ended another way) is one decision, kept here in one piece.
What proves a write over as it happens (P's reply, P found gone) is the pull task's and
the liveness watch's (:mod:`connectors.mooncake.liveness`). Mixed in front of the
worker, whose state it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Final

from vllm.logger import init_logger

from connectors.mooncake.probe import PullWriter
from connectors.mooncake.pull_state import PeerPull
from kvfail import Stage
from kvfail.blocks import normalise_block_ids

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        PullReqMeta,
    )

    from kvfail.reporter import FailureReporterMixin
    from kvfail.tracker import LoadTracker

__all__ = ["MAX_HOLD_KEY", "WriteFence"]

logger = init_logger(__name__)

#: ``kv_connector_extra_config`` key: the longest a failed load's blocks are held, counted
#: from its deadline, without proof that P's push is over. Default: no bound. No time
#: measured on D bounds P's push: P's own expiry only bounds how long P waits for its
#: prefill once the pull reached it, and a slow or stopped P may receive the pull, and
#: then push, at any later time. Setting it trades that wrong-KV risk for capacity.
MAX_HOLD_KEY: Final = "kvfail_max_hold_s"


class WriteFence:
    """The fence and the holds of a Mooncake worker; see the module's docstring."""

    # The worker's state this part reads and changes (set in its ``__init__``).
    _mc_lock: threading.Lock
    _mc_tasks: defaultdict[str, set[asyncio.Task[Any]]]
    _mc_fenced_at: dict[str, float]
    _mc_unproven: defaultdict[str, dict[str, PullWriter]]
    _mc_held: dict[str, float]
    _mc_max_hold_s: float | None
    _mc_grace_s: float
    receiver_loop: asyncio.AbstractEventLoop
    failure_reporter: LoadTracker

    if TYPE_CHECKING:  # the reporter mixin's, for the checker only: never shadowed at runtime
        load_failed = FailureReporterMixin.load_failed
        load_fenced = FailureReporterMixin.load_fenced

    def _mc_fail_unreported(
        self, state: PeerPull, pulls: dict[str, PullReqMeta], stage: Stage, reason: str
    ) -> None:
        """Fail what this pull has not settled yet. A request P may still push into (the
        exchange ended without P's answer for it: a socket error or timeout) is failed
        unfenced where quarantine exists: reported now, its blocks held until P's death
        proves the push over (``_mc_release_proven``) or the max hold passes."""
        may_write = state.may_still_write(pulls) if self.failure_reporter.quarantine else set()
        for req_id in pulls.keys() - state.reported:
            state.reported.add(req_id)
            # A load with no blocks (notify-only) has nothing to hold: the tracker never
            # quarantines it, so a hold entry would never end.
            if req_id in may_write and normalise_block_ids(pulls[req_id].local_block_ids).flat:
                with self._mc_lock:
                    self._mc_held.setdefault(req_id, time.monotonic())
                if self.load_failed(req_id, stage, reason, peer=state.peer, fenced=False):
                    continue
                with self._mc_lock:
                    self._mc_held.pop(req_id, None)
            else:
                self.load_failed(req_id, stage, reason, peer=state.peer)

    def kvfail_fence(self, req_id: str) -> bool:
        """Whether nothing can still write into an overdue (or quarantined) load's blocks.

        Mooncake is P-push: once P holds D's pull request, it writes into D's registered
        KV memory with its own TransferEngine whenever it gets to it, and D holds no handle
        to cancel. No clock on D bounds that write: a stopped P may receive the pull late
        and push after any wait. What proves it over is P itself: its reply naming the
        request or ending the exchange (it replies only after pushing), or its process
        found gone by the probe. So:

        * no pull task started (bootstrap phase), or every task ended with that proof:
          fenced;
        * with quarantine (the tracker's, see :mod:`kvfail.quarantine`): the load was
          already reported at its deadline; the pull keeps running, and its blocks stay
          held until the proof comes. ``kvfail_max_hold_s``, if set, is an outer bound
          chosen by the operator, at which the tasks are cancelled;
        * without quarantine (an older vLLM cannot hold blocks of a reported load): the
          tasks are cancelled (a late reply is never read), and ``kvfail_fence_grace_s``
          holds the request that much longer first; choose the deadline plus the grace
          above how long P may take to push.
        """
        now = time.monotonic()
        with self._mc_lock:
            tasks = tuple(self._mc_tasks.get(req_id, ()))
            writing = bool(tasks) or bool(self._mc_unproven.get(req_id))
            first = self._mc_fenced_at.setdefault(req_id, now)
        quarantine = self.failure_reporter.quarantine
        bound = self._mc_max_hold_s
        if writing and quarantine and (bound is None or now - first < bound):
            return False
        for task in tasks:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self.receiver_loop.call_soon_threadsafe(task.cancel)
        if writing and not quarantine and now - first < self._mc_grace_s:
            return False
        with self._mc_lock:
            self._mc_fenced_at.pop(req_id, None)
            self._mc_unproven.pop(req_id, None)
            self._mc_held.pop(req_id, None)
        if writing:
            logger.warning(
                "kvfail: %s's blocks released %.1f s after its deadline without proof that "
                "P's push is over (kvfail_max_hold_s or kvfail_fence_grace_s)",
                req_id,
                now - first,
            )
        return True

    def _mc_expire_holds(self) -> None:
        """Past ``kvfail_max_hold_s``, release loads held by :meth:`_mc_fail_unreported`."""
        bound = self._mc_max_hold_s
        assert bound is not None
        now = time.monotonic()
        with self._mc_lock:
            due = [r for r, since in self._mc_held.items() if now - since >= bound]
            for req_id in due:
                del self._mc_held[req_id]
                self._mc_unproven.pop(req_id, None)
        for req_id in due:
            logger.warning("kvfail: %s's blocks released at kvfail_max_hold_s, unproven", req_id)
            self.load_fenced(req_id)

    def _mc_forget_ended(self) -> None:
        """Drop bookkeeping of loads that ended another way than the one that pops it (a
        hold released by P's death, a fence that never said True, a notify-only load):
        a load neither tracked nor held keeps nothing here."""
        tracker = self.failure_reporter
        with self._mc_lock:
            for table in (self._mc_fenced_at, self._mc_held):
                for req_id in [
                    r for r in table if not tracker.is_tracked(r) and not tracker.is_quarantined(r)
                ]:
                    del table[req_id]

    def kvfail_peer_of(self, req_id: str) -> str | None:
        """The P worker(s) a held load may still be pushed from."""
        with self._mc_lock:
            addrs = sorted(self._mc_unproven.get(req_id, ()))
        return ",".join(addrs) or None
