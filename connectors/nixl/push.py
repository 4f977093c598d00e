"""Upstream's NIXL *push* connector with its D-side failures routed through kvfail.

In push mode P WRITEs into D's blocks: D's scheduler stages a registration (D's block
ids, D's side channel), D's worker handshakes with P (notification agents only) and
sends it as a ``PUSH_REG`` notification, P matches it with its finished request,
handshakes back with D and posts the WRITE, whose NIXL notification tells D the bytes
are there. D owns no transfer handle, so it cannot cancel anything: once P has a
registration, only P decides whether and when it writes. Upstream D has no working
deadline (the scheduler's registration "watchdog" only logs), so a P that dies or
stops strands the request with its blocks.

Here, as in :mod:`connectors.nixl.connector`, every D-side event is one call into the
mixin:

* a load with local blocks is tracked when the worker first sees it (``track_load``);
* P's completion notification finishes it (``load_succeeded``, from upstream's
  ``finished_recving``);
* a failed registration handshake, or no agent to send it to, fails it at ``handshake``
  (fenced: P never got the registration, and a handshake that ends later never sends
  it, see :meth:`KvfailNixlPushWorker._do_send_reg_notif`);
* a load whose P's side channel refuses connections, or whose host stops resolving, is
  failed at ``peer_lost`` and reported at once (:mod:`connectors.nixl.peer_watch`, as in
  pull mode): a P that dies after D's registration went out sends nothing more, and D
  posted no transfer that could fail; its blocks are held as below;
* the deadline (``kvfail_deadline_s``) fails it at ``watchdog`` and reports it at once,
  request-level, so recompute runs in fresh blocks. Its fence
  (:meth:`KvfailNixlPushWorker.kvfail_fence`) holds (False) while P may still write:
  the registration went out and neither P's completion notification arrived nor is P
  known dead. :class:`~kvfail.vllm_quarantine.QuarantineConnector` keeps the blocks out
  of the free pool until then, bounded by its cap;
* a completion notification for a load D already failed is counted as a late report
  and never passed to the scheduler (C7); it ends the hold.

What ends a hold is evidence from the writers themselves (see ``README.md``, "What ends
a hold"): a completion notification from every P rank that writes here (P's pipeline
stages x P ranks per D rank, counted as upstream's worker counts them), or proof that
every writer's process is gone. A refusal of P's side channel proves only that its
listener closed: P's WRITEs may come from other processes (its TP/PP workers), and even
at TP 1, where listener and writer share a process, vLLM's graceful shutdown closes the
listener while a WRITE may still be under way. So the hold also asks the writers' own
transport: D's NIXL agent sends each of P's rank agents a notification, and only if
every one fails with ``nixlRemoteDisconnectError`` (UCX closed the endpoint to that
process) as well as the side channel refusing is P taken as gone. A stopped P keeps its
endpoints, so it stays held. P's own lease is no such bound either: D cannot observe it,
and on P it only drops requests not yet matched, never a WRITE already posted or one
matched right after a thaw.

Holds are bounded for visibility, not freed: past ``kvfail_max_hold_s`` (default
:data:`MAX_HOLD_DEADLINES` deadlines) a hold without that evidence stays held, is counted
(``kvfail_holds_overdue``) and logged once with its P (the scheduler side's WARNING
names every lasting hold's P); the quarantine cap bounds the blocks.

Nothing here copies upstream code or patches vLLM; the overridden methods are
upstream's private ones (vLLM 0.32.0) and each calls upstream's version.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from connectors.config import NixlPushKvfailConfig, validate_extra_config
from connectors.nixl.connector import (
    KvfailNixlWorkerMixin,
    _deadline_from,
    _extra,
)
from connectors.nixl.probe import PROBE_INTERVAL_S
from connectors.nixl.stats import KvfailNixlStats
from kvfail.deadline import seconds_from
from kvfail.stages import Stage
from kvfail.vllm_quarantine import QuarantineConnector
from kvfail.vllm_stats import KvfailMetricsConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "PUSH_FAILURE_STAGES",
    "KvfailNixlPushConnector",
    "KvfailNixlPushWorker",
]

logger = logging.getLogger("kvfail.nixl.push")

#: Upstream ``_log_failure`` types on D's push path that fail the load. Both mean the
#: registration was never sent, so nothing can write. ``push_reg_notif_failed`` is absent:
#: a failed send does not prove P did not get it, so the load waits for its deadline.
PUSH_FAILURE_STAGES: Final[dict[str, Stage]] = {"push_reg_handshake_failed": Stage.HANDSHAKE}
#: How long a load fenced before its registration went out stays closed to a late send.
#: A handshake still pending then ends within zmq's receive timeout and re-queues the
#: registration once; this outlasts that with room to spare, and bounds the memory.
CLOSED_KEEP_S: Final = 120.0
#: ``kv_connector_extra_config`` key: how long a hold may last before it is reported
#: overdue (counted, and named once in a WARNING with its P). Never a release: past it a
#: hold without evidence stays held (see the module docstring).
MAX_HOLD_KEY: Final = "kvfail_max_hold_s"
#: Its default, in load deadlines (a P that wrote late writes within a few deadlines).
MAX_HOLD_DEADLINES: Final = 4
#: How often a held load's fence is retried: a notification ends a hold by itself
#: (:meth:`KvfailNixlPushWorker._late_notification`), so the retry only advances the
#: probe and the overdue check, which the probe's own interval paces anyway.
HOLD_RETRY_S: Final = PROBE_INTERVAL_S
#: The notification a held load sends P's rank agents to learn whether their processes
#: are gone: a heartbeat naming no request, which a live NIXL worker takes as a no-op
#: (any other text would reach its completion parsing).
WRITER_PING: Final = b"HB:"


@dataclass
class _Held:
    """A failed load whose registration P may still act on."""

    host: str
    port: int
    #: P's engine id: names the rank agents D handshook with (the writers here).
    engine_id: str = ""
    #: P's pipeline stages: each stage's ranks write their own layers and notify apart.
    pp_size: int = 1
    #: P's completion notifications owed (one per P rank writing here); None until the
    #: first arrives, as upstream learns P's TP size from it.
    owed: int | None = None
    #: Notifications received, those before the fence included (upstream counted them).
    notified: int = 0
    done: bool = False
    #: When the hold began: a refusal seen before it may be about an earlier P on the
    #: same host and port, so it does not count for this load.
    since: float = field(default_factory=time.monotonic)
    #: What was already said about this hold (each once).
    said_overdue: bool = False
    said_unresolved: bool = False
    said_refused: bool = False

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}" if self.port else "an unknown P"


class KvfailNixlPushWorker(KvfailNixlWorkerMixin, NixlPushConnectorWorker):
    """``NixlPushConnectorWorker`` (D side) whose failures all go through the tracker."""

    KVFAIL_LOG_STAGES = PUSH_FAILURE_STAGES

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        deadline = _deadline_from(vllm_config)
        self._init_push_state(
            seconds_from(
                _extra(vllm_config),
                MAX_HOLD_KEY,
                None if deadline is None else MAX_HOLD_DEADLINES * deadline,
            )
        )
        # A push P may still make is reported at the deadline; the scheduler half holds
        # its blocks until P's write is provably over.
        self._kvfail_init_reporter(
            vllm_config,
            engine_id,
            kv_cache_config,
            connector="KvfailNixlPushConnector",
            fence_retry_s=HOLD_RETRY_S,
        )

    def _init_push_state(self, max_hold_s: float | None = None) -> None:
        """kvfail's own state (apart, so a unit test can build it without an agent)."""
        self._kvfail_max_hold_s = max_hold_s
        # Registration state is shared by the writer thread (sends) and the engine
        # thread (fence); this lock makes "sent" and "never to be sent" exclusive.
        self._kvfail_reg_lock = threading.Lock()
        self._kvfail_reg_sent: set[str] = set()
        self._kvfail_reg_closed: dict[str, float] = {}
        self._kvfail_held: dict[str, _Held] = {}
        self._kvfail_init_peer_watch(PROBE_INTERVAL_S)
        #: Completion notifications for loads D already failed (C7: counted, not passed).
        self.kvfail_late_notifications = 0
        #: Holds that passed ``kvfail_max_hold_s`` without evidence (since creation).
        self.kvfail_holds_overdue = 0

    # ------------------------------------------------------------------ loads start

    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> None:
        """Send a registration only for a load still waiting, and remember it was sent.

        A handshake that ends after the deadline re-queues the registration; by then the
        load was reported and its blocks may belong to another request, so P must never
        learn them. Runs on the writer thread.
        """
        with self._kvfail_reg_lock:
            tracker = self.failure_reporter
            if req_id in self._kvfail_reg_closed or not tracker.is_tracked(req_id):
                logger.warning("kvfail: not sending a registration for ended load %r", req_id)
                return
            self._kvfail_reg_sent.add(req_id)
            # Under the lock: a fence deciding "never sent" must not interleave.
            super()._do_send_reg_notif(req_id, reg_data)

    # ------------------------------------------------------------------ failures

    def _kvfail_unlogged_failure(self, req_id: str) -> tuple[Stage, str]:
        """The D path that logs no failure: no P agent to send the registration to."""
        return Stage.HANDSHAKE, "no P agent for the registration"

    def kvfail_fence(self, req_id: str) -> bool:
        """True once P can no longer write into this load's blocks.

        Never sent: closed for good, so a late handshake cannot send it. Sent: held
        until P's completion notifications for it arrived or P is known dead (its side
        channel refuses connections). Upstream forgets the load here, so a late
        notification is never passed on (see :meth:`_get_new_notifs`).
        """
        with self._kvfail_reg_lock:
            sent = req_id in self._kvfail_reg_sent
            if not sent:
                now = time.monotonic()
                closed = self._kvfail_reg_closed
                for old in [r for r, t in closed.items() if now - t > CLOSED_KEEP_S]:
                    del closed[old]
                closed[req_id] = now
        meta = self._recving_metadata.pop(req_id, None)
        # Notifications that came before the fence count toward what is owed.
        notified = self.consumer_notification_counts_by_req.pop(req_id, 0)
        if not sent:
            return True
        held = self._kvfail_held.get(req_id)
        if held is None:
            held = self._kvfail_held[req_id] = _held_from(meta, notified)
        else:
            held.notified += notified  # counted by upstream since the last try
        if held.done or self._p_dead(req_id, held):
            self._forget(req_id)
            return True
        self._say_overdue(req_id, held)
        return False

    def _say_overdue(self, req_id: str, held: _Held) -> None:
        """Count, and name once, a hold past ``kvfail_max_hold_s``; it stays held."""
        bound = self._kvfail_max_hold_s
        if held.said_overdue or bound is None or time.monotonic() - held.since < bound:
            return
        held.said_overdue = True
        self.kvfail_holds_overdue += 1
        # INFO: the scheduler side names every lasting hold's P in one WARNING.
        logger.info(
            "kvfail: load %r held %.0f s (past kvfail_max_hold_s) for P %s: %d of %s "
            "completion notifications came and P's writers are not proven gone, so its "
            "blocks stay held (the quarantine cap bounds them)",
            req_id,
            time.monotonic() - held.since,
            held.peer,
            held.notified,
            "?" if held.owed is None else held.owed,
        )

    def kvfail_peer_of(self, req_id: str) -> str | None:
        held = self._kvfail_held.get(req_id)
        return held.peer if held is not None and held.port else None

    def _forget(self, req_id: str) -> None:
        self._kvfail_held.pop(req_id, None)
        with self._kvfail_reg_lock:
            self._kvfail_reg_sent.discard(req_id)
        if self._kvfail_probes is not None:
            self._kvfail_probes.forget(req_id)

    # ------------------------------------------------------------------ P dead?

    def _p_dead(self, req_id: str, held: _Held) -> bool:
        """Whether P's writers are proven gone: its side channel refuses connections since
        the hold began, and D's NIXL endpoint to every writer reports its process gone
        (see the module docstring). A refusal alone is a closed listener, not a stopped
        writer: a graceful shutdown closes it while a WRITE is still under way, even at
        TP 1 where listener and writer share a process. A stopped or slow P counts as
        alive; a name that no longer resolves proves nothing (said once, the hold stays)."""
        if not held.port:
            return False
        addr = (held.host, held.port)
        probes = self._kvfail_probes
        if probes is None:
            return False
        if probes.gone(addr, since=held.since, waiter=req_id):
            if self._writers_disconnected(held):
                logger.warning(
                    "kvfail: P %s is gone: its side channel refuses connections and every "
                    "writer rank's NIXL endpoint reports the remote disconnected; releasing %r",
                    held.peer,
                    req_id,
                )
                return True
            if not held.said_refused:
                held.said_refused = True
                logger.warning(
                    "kvfail: P %s's side channel refuses connections, but not every writer "
                    "of %r (%d pipeline stage(s)) is proven gone: a closed listener is not "
                    "a stopped WRITE; the hold stays until the writers' notifications or "
                    "their processes are gone",
                    held.peer,
                    req_id,
                    held.pp_size,
                )
        elif (why := probes.unresolved(addr, since=held.since)) is not None and not (
            held.said_unresolved
        ):
            held.said_unresolved = True
            logger.warning("kvfail: held load %r: P's side channel host %s", req_id, why)
        return False

    def _writers_disconnected(self, held: _Held) -> bool:
        """Whether D's NIXL endpoint to every P rank agent it handshook with is closed.

        The evidence comes from the writers' own processes: a notification to a live or
        stopped agent is accepted (its connection stays up), and UCX answers one to a
        process that is gone with ``nixlRemoteDisconnectError``. Any other outcome, or
        no agent known, proves nothing."""
        agents = self._remote_agents.get(held.engine_id) if held.engine_id else None
        if not agents:
            return False
        # Keyed (pipeline stage, TP rank): every stage of P writes here, so an agent list
        # missing a stage cannot speak for that stage's writers.
        if not set(range(held.pp_size)) <= {stage for stage, _ in agents}:
            return False
        for name in list(agents.values()):
            try:
                self.nixl_wrapper.send_notif(name, WRITER_PING)
            except Exception as exc:  # the binding's own class; matched by name below
                if type(exc).__name__ != "nixlRemoteDisconnectError":
                    return False
            else:
                return False
        return True

    # ------------------------------------------------------------------ notifications

    def _get_new_notifs(self) -> set[str]:
        """Take P's completion notifications for held loads before upstream sees them.

        Upstream would log one as an unrecognized request; here it is counted as a late
        report (the tracker refuses the id: C7, never reaches the scheduler) and ends
        the hold once every P rank writing here has notified.
        """
        if self._kvfail_held:
            keep: list[bytes] = []
            while True:
                try:
                    notif = self._pending_completion_notifs.get_nowait()
                except queue.Empty:
                    break
                if not self._late_notification(notif):
                    keep.append(notif)
            for notif in keep:
                self._pending_completion_notifs.put(notif)
        return super()._get_new_notifs()

    def _late_notification(self, notif: bytes) -> bool:
        try:
            msg = notif.decode("utf-8")
        except UnicodeDecodeError:
            return False
        if msg.startswith("HB:"):
            return False
        req_id, _, tp_size = msg.rpartition(":")
        held = self._kvfail_held.get(req_id)
        if held is None or not tp_size.isdigit():
            return False
        if held.owed is None:
            # As upstream's worker counts them: every pipeline stage of P, times the P
            # ranks writing into this D rank (more than one when P's TP is larger).
            held.owed = held.pp_size * max(1, int(tp_size) // self.world_size)
        held.notified += 1
        self.kvfail_late_notifications += 1
        self.load_succeeded(req_id)  # counted as a late report, never delivered
        if held.notified >= held.owed and not held.done:
            held.done = True
            logger.warning("kvfail: P's late write for failed load %r is over", req_id)
            if self.load_fenced(req_id):
                self._forget(req_id)
        return True

    # ------------------------------------------------------------------ per step

    def _kvfail_settled(self, finished: set[str]) -> None:
        """A registration of a load upstream finished is no longer outstanding."""
        if finished:
            with self._kvfail_reg_lock:
                self._kvfail_reg_sent -= finished


def _held_from(meta: Any, notified: int) -> _Held:
    """The hold of a load whose registration went out, from its (popped) metadata."""
    remote = None if meta is None else meta.remote
    pp_size = max(1, int(getattr(meta, "pp_size", 1) or 1))
    if remote is None or not remote.host or not remote.port:
        held = _Held("", 0, pp_size=pp_size)  # nowhere to probe: only notifications end it
    else:
        held = _Held(
            remote.host,
            int(remote.port),
            engine_id=remote.engine_id or "",
            pp_size=pp_size,
        )
    held.notified = notified
    return held


class KvfailNixlPushConnector(QuarantineConnector, KvfailMetricsConnector, NixlPushConnector):
    """``NixlPushConnector`` with :class:`KvfailNixlPushWorker` as its worker.

    Load with ``kv_connector="KvfailNixlPushConnector"``,
    ``kv_connector_module_path="connectors.nixl"``. Extra config ``kvfail_deadline_s``
    sets D's deadline. A P may run upstream's ``NixlPushConnector`` or this class: on P
    nothing is changed.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        validate_extra_config(_extra(vllm_config), NixlPushKvfailConfig)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        # NixlPushConnector.__init__ would build upstream's worker (a second NIXL agent).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        #: The load deadline the worker enforces, declared for the conformance suite.
        self.kv_load_deadline_s = _deadline_from(vllm_config)
        self.connector_scheduler: NixlPushConnectorScheduler | None = None
        self.connector_worker: NixlPushConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPushConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvfailNixlPushWorker(
                vllm_config, self.engine_id, kv_cache_config
            )
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvfailNixlStats(data=data) if data is not None else KvfailNixlStats()
