"""Upstream's NIXL pull connector with its D-side failure handling routed through kvfail.

Upstream (``vllm.distributed.kv_transfer.kv_connector.v1.nixl``) already detects most
failures; what it lacks is one place that decides what the scheduler is told. Its
bookkeeping is spread over ``_recv_failures`` (a set), ``_failed_recv_reqs`` (a queue fed
by the handshake thread) and ``_invalid_block_ids`` (a queue of block sets), it has no
deadline for a transfer stuck in ``PROC`` (a silent peer holds D's blocks forever), and
it picks block- vs request-level reporting by "has a non-full-attention layer" rather than
by group count, so a failed load with several full-attention KV-cache groups reports
group-0 block ids and crashes the engine (seen on 0.32.0; its HMA TODO). The tracker
routes by group count. Here every D-side failure becomes one
:meth:`FailureReporterMixin.load_failed` call, and the tracker decides delivery:

* where a failure is *detected* we learn its stage from ``_log_failure``, the structured
  log line upstream emits exactly once per failure (and that vLLM's tests match on);
* ``_handle_failed_transfer`` keeps upstream's side effects (NIXL counters, marking the
  remote engine for cleanup, retaining a handle whose release failed) and backs the stage
  up for the failure paths that log nothing (invalid remote engine, expired turn-2 read);
* ``get_transfer_results`` lets upstream poll handles and post-process successes, then
  settles each finished load in the tracker and returns the tracker's report; upstream's
  own failed set and invalid-block queue are drained and discarded;
* a load older than ``kvfail_deadline_s`` is failed by the tracker's watchdog and
  reported at once; :meth:`KvfailNixlWorker.kvfail_fence` lets its blocks go back only
  once every NIXL handle it posted has ended and been released, and until then the
  blocks are quarantined (C11);
* a load whose P process is gone (its side channel refuses connections, see
  :mod:`connectors.nixl.probe`) is failed at ``peer_lost`` and reported at once, its
  blocks quarantined the same way until its READs have ended. UCX alone learns of a
  dead P only when its endpoint fails, which can take many seconds.

Upstream's failed set ``_recv_failures`` is still filled, on purpose: it is what makes
upstream skip KV post-processing for a failed request (vLLM #40364; post-processing a
request whose handshake failed would look up an unknown engine). It is never reported.

Stage map: ``handshake_failed`` -> HANDSHAKE; ``transfer_setup_failed`` -> TRANSFER_SETUP;
``transfer_failed`` (state ERR) and ``transfer_exception`` -> TRANSFER; read refused for an
invalidated peer, and P's side channel refusing -> PEER_LOST; other unlogged refusals
(expired turn-2 read) -> TRANSFER_SETUP; deadline -> WATCHDOG; ``notification_failed`` ->
not a load failure.

Nothing here copies upstream code or patches vLLM. The overridden methods are upstream's
private ones (tied to vLLM 0.32.0's NIXL internals), and each calls upstream's version.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from connectors.config import NixlPullKvfailConfig, validate_extra_config
from connectors.nixl.layout import RemoteLayout, check_remote_layout
from connectors.nixl.peer_watch import PeerWatch
from connectors.nixl.probe import PROBE_INTERVAL_S
from connectors.nixl.stats import KvfailNixlStats
from kvfail import compat
from kvfail.compat import KVConnectorTransferResults
from kvfail.deadline import DEADLINE_KEY, PROBE_INTERVAL_KEY, seconds_from
from kvfail.quarantine import NamedHolds
from kvfail.reporter import FailureReporterMixin
from kvfail.stages import Stage
from kvfail.vllm_quarantine import QuarantineConnector, worker_hold_rank
from kvfail.vllm_stats import KvfailMetricsConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlConnectorMetadata,
        ReqMeta,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvfail.nixl")

#: Default D-side deadline of one load (extra config ``kvfail_deadline_s``), from the step
#: the worker first sees it to the step it can be reported; ``null`` or 0 disables it.
#: Upstream has none for a transfer stuck in ``PROC``; 30 s matches upstream's P-side
#: ``kv_lease_duration`` default, after which P frees the blocks anyway, so a load still
#: unfinished at that point cannot complete correctly.
DEFAULT_DEADLINE_S: Final = 30.0
#: How often a fence whose handle release failed is retried (each drain after this).
FENCE_RETRY_S: Final = 0.1
#: Bound on the plain TCP connect to P's side channel before each handshake (see
#: :meth:`KvfailNixlWorker._nixl_handshake`); on loopback a refusal comes back at once.
SIDE_CHANNEL_PROBE_S: Final = 0.5

#: Upstream ``_log_failure`` types that fail the request, and where they are detected.
#: ``notification_failed`` is absent on purpose: a notification is not a load. Upstream D
#: sends one of its own (``send_notif``) only where nothing is left to load (a pull with no
#: blocks: a request aborted before its first schedule, a full local hit) or after a split
#: DRAM/device READ is DONE; an ordinary READ carries its notification, whose loss D never
#: sees. Either way D's blocks already hold P's bytes and nothing can still write into
#: them, so the load is reported finished and not failed (failing it would turn a good
#: answer into an error under ``fail``); upstream counts the failed send
#: (``num_failed_notifications``, in the merged stats) and P frees its blocks when its send
#: lease (``kv_lease_duration``) ends. The suite's ``notify_failed`` scenario checks this.
#: ``handshake_setup_failed`` is engine-level (no request id); each waiting request gets
#: its own ``handshake_failed``. ``transfer_release_failed`` is handled by retention.
FAILURE_STAGES: Final[dict[str, Stage]] = {
    "handshake_failed": Stage.HANDSHAKE,
    "transfer_setup_failed": Stage.TRANSFER_SETUP,
    "transfer_failed": Stage.TRANSFER,
    "transfer_exception": Stage.TRANSFER,
}


def _refuses(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connect to ``host:port`` is refused (nothing listens there). A
    connect that succeeds, times out or fails otherwise says nothing: False."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _extra(vllm_config: VllmConfig) -> Mapping[str, Any] | None:
    kv_config = vllm_config.kv_transfer_config
    return None if kv_config is None else kv_config.kv_connector_extra_config


def failed_transfer_kwargs(record_failed_transfer: bool) -> dict[str, bool]:
    """Upstream's ``record_failed_transfer`` only when it is not its default: vLLM 0.30's
    ``_handle_failed_transfer`` has no such parameter (and never passes it), later
    releases default it to True."""
    return {} if record_failed_transfer else {"record_failed_transfer": False}


def _deadline_from(vllm_config: VllmConfig) -> float | None:
    return seconds_from(_extra(vllm_config), DEADLINE_KEY, DEFAULT_DEADLINE_S)


class LoggedFailureStages:
    """Upstream's single failure log line (``_log_failure``, emitted once per failure and
    matched on by vLLM's tests), then one mixin call for the failure types that fail a
    load, with the stage the worker's ``KVFAIL_LOG_STAGES`` gives them. Shared by the
    pull and push workers; put it before :class:`FailureReporterMixin` and upstream's
    worker."""

    KVFAIL_LOG_STAGES: ClassVar[Mapping[str, Stage]] = {}

    def _log_failure(
        self,
        failure_type: str,
        req_id: str | None,
        msg: str = "",
        error: BaseException | None = None,
        meta: ReqMeta | None = None,
        **extra_context: Any,
    ) -> None:
        super()._log_failure(failure_type, req_id, msg, error, meta, **extra_context)  # type: ignore[misc]
        stage = self.KVFAIL_LOG_STAGES.get(failure_type)
        if stage is None or req_id is None:
            return
        reason = failure_type if error is None else f"{failure_type}: {error!r}"
        # settle=False: upstream still holds the request (handles, or its failed queue);
        # it is settled when upstream reports it done.
        self.load_failed(req_id, stage, reason, settle=False)  # type: ignore[attr-defined]


class TrackerDecides:
    """The pull and push workers' report, one implementation for both: upstream polls
    and post-processes, the tracker decides what is reported. Put it first among the
    worker's bases, with :class:`FailureReporterMixin` right before upstream's worker."""

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Upstream polls and post-processes; the tracker decides what is reported."""
        # Loads without local blocks (a full local hit the scheduler still awaits) are
        # upstream's to complete and never fail: their KV is already local.
        recving: Any = self._recving_metadata  # type: ignore[attr-defined]
        no_blocks = {r for r, m in recving.items() if not any(m.local_block_ids)}
        self._kvfail_before_poll()
        upstream = super().get_transfer_results()  # type: ignore[misc]
        # Upstream's invalid-block queue (the class after the tracker's) is superseded by
        # the tracker; drain it so it does not grow.
        super(FailureReporterMixin, self).get_block_ids_with_load_errors()  # type: ignore[misc]
        passthrough = upstream.finished_recving & no_blocks
        finished = upstream.finished_recving - passthrough
        for req_id in finished:
            # No outstanding handles: the load is settled, failed or not (sticky). An id
            # the tracker no longer knows is counted and dropped, never passed on (C7).
            self.load_succeeded(req_id)  # type: ignore[attr-defined]
        self._kvfail_settled(finished)
        results: KVConnectorTransferResults = self.transfer_results(  # type: ignore[attr-defined]
            upstream.finished_sending, finished_recving=passthrough
        )
        return results

    def _kvfail_settled(self, finished: set[str]) -> None:
        """Hook: the loads upstream finished, now settled in the tracker."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return FailureReporterMixin.get_block_ids_with_load_errors(self)  # type: ignore[arg-type]

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Upstream's NIXL telemetry and kvfail's counters for this interval, merged."""
        upstream = super().get_kv_connector_stats()  # type: ignore[misc]
        return KvfailNixlStats.merged(upstream, self.take_failure_stats())  # type: ignore[attr-defined]

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """Track every load that has blocks to receive before upstream starts it.

        A load without local blocks (a full local prefix hit, an aborted request's
        cleanup) is left to upstream: it only notifies P (pull) or sends nothing (push),
        and its KV is already local, so it must never be reported failed.
        """
        for req_id, meta in metadata.reqs_to_recv.items():
            if any(meta.local_block_ids):
                self.track_load(req_id, meta.local_block_ids)  # type: ignore[attr-defined]
        super().start_load_kv(metadata)  # type: ignore[misc]

    def _kvfail_init_reporter(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        *,
        connector: str,
        fence_retry_s: float,
    ) -> None:
        """The tracker, set up alike for pull and push (only the name and the fence's
        retry differ): the deadline from the extra config, and quarantine where vLLM lets
        the scheduler half hold blocks, so a load whose transfer may still write is
        reported at the deadline anyway while its blocks stay held."""
        tp_rank: int = self.tp_rank  # type: ignore[attr-defined]
        self.init_failure_reporter(  # type: ignore[attr-defined]
            num_kv_cache_groups=len(kv_cache_config.kv_cache_groups),
            name=f"{connector}[{engine_id}:tp{tp_rank}]",
            default_deadline_s=_deadline_from(vllm_config),
            fence_retry_s=fence_retry_s,
            quarantine=compat.block_pool_binding_available(),
            rank=worker_hold_rank(vllm_config, tp_rank),
        )

    def _handle_failed_transfer(
        self,
        req_id: str,
        handle: Any,
        failed_req_ids: set[str] | None = None,
        record_failed_transfer: bool = True,
    ) -> bool:
        """Upstream's side effects, plus a stage for the paths that log no failure (see
        :meth:`_kvfail_unlogged_failure`)."""
        tracker = self.failure_reporter  # type: ignore[attr-defined]
        if tracker.is_tracked(req_id) and tracker.failure_of(req_id) is None:
            stage, reason = self._kvfail_unlogged_failure(req_id)
            self.load_failed(req_id, stage, reason, settle=False)  # type: ignore[attr-defined]
        return super()._handle_failed_transfer(  # type: ignore[misc,no-any-return]
            req_id, handle, failed_req_ids, **failed_transfer_kwargs(record_failed_transfer)
        )

    def _kvfail_unlogged_failure(self, req_id: str) -> tuple[Stage, str]:
        """Hook: the stage and reason of a failed transfer upstream logged nothing for."""
        raise NotImplementedError


class KvfailNixlWorkerMixin(
    PeerWatch, TrackerDecides, NamedHolds, LoggedFailureStages, FailureReporterMixin
):
    """The pull and push workers' kvfail bases, in the one order they need (the tracker's
    report first, the reporter mixin last): put it right before upstream's worker."""


class KvfailNixlWorker(KvfailNixlWorkerMixin, NixlPullConnectorWorker):
    """``NixlPullConnectorWorker`` whose failures all go through the kvfail tracker."""

    KVFAIL_LOG_STAGES = FAILURE_STAGES

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        # Refused before upstream starts its agent and threads: failed loads are put in
        # upstream's failed set so it skips post-processing them (vLLM #40364).
        compat.require("nixl_failed_set", "KvfailNixlConnector")
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # A READ whose handle will not release is reported at the deadline anyway; the
        # scheduler half holds its blocks until the fence releases the handle.
        self._kvfail_init_reporter(
            vllm_config,
            engine_id,
            kv_cache_config,
            connector="KvfailNixlConnector",
            fence_retry_s=FENCE_RETRY_S,
        )
        # How often a P that loads wait on is probed; off (null or 0): a dead P is left
        # to UCX and the deadline.
        self._kvfail_init_peer_watch(
            seconds_from(_extra(vllm_config), PROBE_INTERVAL_KEY, PROBE_INTERVAL_S)
        )

    # ------------------------------------------------------------------ loads start

    def _read_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        """Refuse to post a READ for a load the watchdog already fenced and delivered.

        A handshake that completes after the deadline still queues the request in
        ``_ready_requests``; by then the scheduler may have reused its blocks.
        """
        if any(meta.local_block_ids) and req_id not in self._recving_metadata:
            logger.warning("kvfail: not starting a read for fenced load req_id=%r", req_id)
            return
        super()._read_blocks_for_req(req_id, meta)

    # ------------------------------------------------------------------ handshake

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Upstream's handshake, after a plain TCP connect to P's side channel.

        zmq retries a refused connect silently, so upstream learns that nothing listens
        there (P gone, or not up yet) only from its receive timeout, seconds later. A
        refusal is an answer: the loads waiting on this P fail at ``handshake`` now (this
        runs in upstream's handshake thread; its failure path reports them). A connect
        that does not complete in time (a path that drops packets) proves nothing and is
        left to upstream's timeout and the deadline.
        """
        if _refuses(host, port, SIDE_CHANNEL_PROBE_S):
            raise ConnectionRefusedError(f"kvfail: P's side channel {host}:{port} refused")
        result = super()._nixl_handshake(
            host, port, remote_tp_size, expected_engine_id, *args, **kwargs
        )
        self._kvfail_side_channels[expected_engine_id] = (host, port)
        return result

    def _validate_remote_agent_handshake(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_size: int,
        remote_dcp_size: int = 1,
    ) -> None:
        """Upstream's checks, then kvfail's layout checks, which ``python -O`` keeps.

        Upstream's are mostly ``assert`` statements; a P with another block length would
        otherwise be read into D's blocks and reported a success. A mismatch raises in
        the handshake thread, so every load waiting on this P fails at ``handshake``.
        """
        super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, remote_dcp_size)
        topo = self.transfer_topo
        # vLLM 0.30 has no layer-name routing (no such attribute): every region transfers.
        routed = getattr(self, "_transfer_layer_region_indices", ())
        regions = routed or range(len(self.block_len_per_layer))
        check_remote_layout(
            [self.block_len_per_layer[i] for i in regions],
            RemoteLayout(
                nixl_agent_meta.kv_caches_base_addr,
                nixl_agent_meta.block_lens,
                nixl_agent_meta.block_strides,
            ),
            same_geometry=topo is not None
            and remote_tp_size == topo.tp_size
            and nixl_agent_meta.block_size == topo.block_size,
            has_mamba=self._has_mamba,
        )

    # ------------------------------------------------------------------ failures

    def _kvfail_unlogged_failure(self, req_id: str) -> tuple[Stage, str]:
        """A READ that was never started, or a P upstream gave up on."""
        meta = self._recving_metadata.get(req_id)
        lost = (
            meta is not None
            and meta.remote is not None
            # Upstream's invalid-engine backoff is newer than vLLM 0.31.
            and meta.remote.engine_id in getattr(self, "_invalid_remote_engines", ())
        )
        if lost:
            return Stage.PEER_LOST, "remote engine invalidated"
        return Stage.TRANSFER_SETUP, "read not started"

    def kvfail_fence(self, req_id: str) -> bool:
        """True once no handle of this load can still write into its blocks.

        A READ still in ``PROC`` is left alone: releasing it does not stop a UCX GET whose
        reply is already on its way (over TCP the reply lands after the release, seen in
        the suite as a write into freed blocks). Upstream keeps polling it; once it is
        ``DONE`` or ``ERR`` it is released, by upstream or here, and a retry returns True.
        A release NIXL refuses is kept and retried likewise. Until then the tracker has
        already reported the load and the scheduler half holds its blocks.
        """
        # Until it is forgotten, upstream must treat it as failed (no post-processing).
        self._recv_failures.add(req_id)
        handles = self._recving_transfers.get(req_id, [])
        kept = [h for h in handles if not self._release_if_ended(req_id, h)]
        if kept:
            self._recving_transfers[req_id] = kept
            return False
        self._recving_transfers.pop(req_id, None)
        self._recving_metadata.pop(req_id, None)
        self._pending_recv_notifs.pop(req_id, None)
        self._recv_failures.discard(req_id)
        return True

    def kvfail_peer_of(self, req_id: str) -> str | None:
        """The P a held READ reads from: the side channel its handshake used."""
        meta = self._recving_metadata.get(req_id)
        remote = None if meta is None else meta.remote
        if remote is None:
            return None
        host, port = self._kvfail_side_channels.get(remote.engine_id, (remote.host, remote.port))
        return f"{host}:{port}" if host and port else remote.engine_id or None

    def _release_if_ended(self, req_id: str, handle: Any) -> bool:
        """Release a handle that can no longer write; False keeps it (in flight, unknown
        or refused)."""
        try:
            state = self.nixl_wrapper.check_xfer_state(handle)
        except Exception:  # upstream's own poll logs and handles this
            return False
        if state == "PROC":
            return False
        return self._try_release_xfer_handle(req_id, handle)


class KvfailNixlConnector(QuarantineConnector, KvfailMetricsConnector, NixlPullConnector):
    """``NixlPullConnector`` with :class:`KvfailNixlWorker` as its worker.

    Load with ``kv_connector="KvfailNixlConnector"``,
    ``kv_connector_module_path="connectors.nixl"``. Extra config ``kvfail_deadline_s``
    sets the D-side deadline (default :data:`DEFAULT_DEADLINE_S`).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        validate_extra_config(_extra(vllm_config), NixlPullKvfailConfig)
        # NixlPullConnector.__init__ would build upstream's worker, i.e. a second NIXL
        # agent; build the base and pick the two halves ourselves.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        #: The load deadline the worker enforces, declared for the conformance suite.
        self.kv_load_deadline_s = _deadline_from(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvfailNixlWorker(vllm_config, self.engine_id, kv_cache_config)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvfailNixlStats(data=data) if data is not None else KvfailNixlStats()
