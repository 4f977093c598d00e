"""The liveness half of kvfail's Mooncake worker: on D, the watch of each P worker a
pull goes to and what its two verdicts do; on P, the writer mark its D asks.

Why apart: it is the part of the worker that proves from P's side that a hold may end,
and it reads as one piece: a worker unreachable fails what its pulls owe (blocks held), a
writer proven gone ends the holds (:mod:`connectors.mooncake.probe`,
:mod:`connectors.writer_mark`). The fence and the max hold, which end holds without that
proof, are :mod:`connectors.mooncake.fence`'s. Mixed in front of the worker, whose state
it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from connectors.mooncake.probe import MarkBook, PullWriter, watch_side_channel
from connectors.mooncake.pull_state import PeerPull
from connectors.writer_mark import WriterMark, start_writer_mark
from kvfail import Stage

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        PullReqMeta,
    )

    from kvfail.tracker import LoadTracker

__all__ = ["PeerLiveness"]

logger = init_logger(__name__)


class PeerLiveness:
    """The watch of P workers (D) and the writer mark (P); see the module's docstring."""

    # The worker's state this part reads and changes (set in its ``__init__``).
    _mc_probe_s: float | None
    _mc_probes: dict[str, asyncio.Task[None]]
    _mc_marks: MarkBook
    _mc_lock: threading.Lock
    _mc_inflight: defaultdict[str, dict[asyncio.Task[Any], tuple[PeerPull, dict[str, PullReqMeta]]]]
    _mc_unproven: defaultdict[str, dict[str, PullWriter]]
    _mc_tasks: defaultdict[str, set[asyncio.Task[Any]]]
    _mc_held: dict[str, float]
    _mc_mark: WriterMark | None
    _remote_agents: dict[str, Any]
    _tp_size: dict[str, int]
    hostname: str
    side_channel_port: int
    failure_reporter: LoadTracker

    if TYPE_CHECKING:  # the fence's and the reporter mixin's; never shadowed at runtime

        def _mc_fail_unreported(
            self, state: PeerPull, pulls: dict[str, PullReqMeta], stage: Stage, reason: str
        ) -> None: ...

        def load_fenced(self, req_id: str) -> bool: ...

    def _mc_watch(self, worker_addr: str) -> None:
        """Probe this P worker while a pull to it is in flight or may still write."""
        if self._mc_probe_s and worker_addr not in self._mc_probes:
            self._mc_probes[worker_addr] = asyncio.create_task(
                self._mc_probe_peer(worker_addr, self._mc_probe_s)
            )

    def _mc_writers_at(self, worker_addr: str) -> list[PullWriter]:
        """The writers of the pulls to this P worker in flight or left unproven."""
        writers = [state.writer for state, _ in self._mc_inflight.get(worker_addr, {}).values()]
        with self._mc_lock:
            writers += [w[worker_addr] for w in self._mc_unproven.values() if worker_addr in w]
        return writers

    async def _mc_probe_peer(self, worker_addr: str, interval_s: float) -> None:
        """Watch one P worker's side channel while D has pulls in flight to it, or a pull
        that ended without P's answer may still be written by it (see
        :func:`connectors.mooncake.probe.watch_side_channel`); one task per address, on
        the receiver loop, which owns the registry."""
        me = asyncio.current_task()
        try:
            await watch_side_channel(
                worker_addr,
                interval_s,
                writers=lambda: self._mc_writers_at(worker_addr),
                lost=lambda reason: self._mc_peer_lost(worker_addr, reason),
                gone=lambda reason, ended: self._mc_peer_lost(worker_addr, reason, ended),
                marks=self._mc_marks,
            )
        finally:
            if self._mc_probes.get(worker_addr) is me:
                del self._mc_probes[worker_addr]

    def _mc_peer_lost(
        self, worker_addr: str, reason: str, ended: Collection[PullWriter] = ()
    ) -> None:
        """Fail what the pull tasks to this P worker still owe, then stop the tasks; the
        holds of the pulls whose writer is in ``ended`` (proven gone) end too.

        Without ``ended`` (the side channel refuses) every task there is failed, and the
        requests P may still push into are marked unproven here, before the tasks end,
        so the watch goes on for them. With it (a writer proven gone), only the pulls
        that writer had: a P restarted at the address may be writing those sent since.
        Runs on the receiver loop, like the tasks, so no reply can be processed between
        the report and the cancel; each request gets its one mixin call here, and the
        cancelled task sees it already reported.
        """
        writes_over = bool(ended)
        self._mc_forget_engines_at(worker_addr)
        inflight = self._mc_inflight.get(worker_addr, {})
        for task, (state, pulls) in list(inflight.items()):
            if writes_over and state.writer not in ended:
                continue  # another writer's pull: its own end is yet to be proven
            del inflight[task]
            if writes_over:
                state.over = True  # a writer that is gone writes nothing more
            tracked = self.failure_reporter.is_tracked
            state.reported.update(r for r in pulls if not tracked(r))
            self._mc_fail_unreported(state, pulls, Stage.PEER_LOST, reason)
            if not writes_over:
                unproven = state.may_still_write(pulls)
                with self._mc_lock:
                    for req_id in unproven:
                        self._mc_unproven[req_id][worker_addr] = state.writer
            task.cancel()
        if not inflight:
            self._mc_inflight.pop(worker_addr, None)
        if not writes_over:
            return
        with self._mc_lock:
            cleared = [
                r for r, writers in self._mc_unproven.items() if writers.get(worker_addr) in ended
            ]
            for req_id in cleared:
                writers = self._mc_unproven[req_id]
                del writers[worker_addr]
                if not writers:
                    del self._mc_unproven[req_id]
        self._mc_release_proven(cleared)

    def _mc_release_proven(self, req_ids: Collection[str]) -> None:
        """Give back the blocks of loads held by us once no P worker can write into them.

        Only loads this worker reported with ``fenced=False`` (:attr:`_mc_held`); loads
        the watchdog held are released through :meth:`kvfail_fence` instead.
        """
        with self._mc_lock:
            ready = [
                r
                for r in req_ids
                if r in self._mc_held and not self._mc_tasks.get(r) and not self._mc_unproven.get(r)
            ]
            for req_id in ready:
                del self._mc_held[req_id]
        for req_id in ready:
            self.load_fenced(req_id)

    def _mc_forget_engines_at(self, worker_addr: str) -> None:
        """Make the next pull from a P engine with a dead worker query the bootstrap again.

        Upstream caches each P engine's worker addresses (``_remote_agents``, filled by one
        bootstrap query) for the life of D and never drops them. A P restarted under the
        same engine id listens on new ports, so without this every later pull would go to
        the dead address and fail ``peer_lost`` for ever (seen in the e2e tier: P killed,
        restarted as ``P-mooncake-e2e``, and D kept dialling the old side channel). The
        next pull carries the bootstrap address the router gives it, which names the new
        P. Runs on the receiver loop, the only thread that reads or fills the cache.
        """
        for engine_id, ranks in list(self._remote_agents.items()):
            if any(addr == worker_addr for pps in ranks.values() for addr in pps.values()):
                logger.warning(
                    "kvfail: P engine %s lost its worker %s; it will be looked up on its "
                    "bootstrap server again at the next pull",
                    engine_id,
                    worker_addr,
                )
                del self._remote_agents[engine_id]
                self._tp_size.pop(engine_id, None)

    async def register_worker_with_bootstrap(self) -> None:
        """Open this worker's writer mark on its side channel's port, then register.

        Before registering, so that any D that can learn the address finds the mark.
        Runs on the sender loop, right after upstream bound the side channel.
        """
        self._mc_mark = start_writer_mark(self.hostname, self.side_channel_port)
        await super().register_worker_with_bootstrap()

    def _mc_retire_mark(self) -> None:
        """At shutdown: close the writer mark once this worker's sender threads have no
        write left (new writes are refused from now on), on a thread of its own.

        Upstream stops its sender threads without waiting, and its context teardown can
        wedge while one of them writes: the mark closes when they have all finished,
        never before, whatever upstream's teardown does."""
        mark = getattr(self, "_mc_mark", None)
        if mark is not None:
            threading.Thread(
                target=_close_after_writes,
                args=(getattr(self, "_sender_executor", None), mark),
                name="kvfail-writer-mark-close",
                daemon=True,
            ).start()


def _close_after_writes(executor: Any, mark: WriterMark) -> None:
    """Close ``mark`` once ``executor`` (P's sender threads) has no write left."""
    if executor is not None:
        with contextlib.suppress(Exception):
            executor.shutdown(wait=True)
    mark.close()
