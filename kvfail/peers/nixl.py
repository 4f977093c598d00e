"""A real NIXL P/D pair: P in its own OS process, D engines in this one, UCX TCP on 127.0.0.1.

Why: the conformance suite must see what a *real* NIXL transfer reports when the peer
dies, freezes or is misaddressed, through vLLM's real scheduler. :class:`NixlPair` starts
P (:mod:`kvfail.peers.nixl_producer`: real ``Scheduler`` + real WORKER-role NIXL pull
connector, KV caches as CPU tensors, ``kv_buffer_device="cpu"``, DRAM) as a
:class:`~kvfail.rig.processes.PeerProcess`, and builds D as harness
:class:`~kvfail.harness.Engine` objects *here*, so the suite's oracles read D's real
scheduler directly. D pulls (READ) P's blocks after the zmq side-channel handshake that
``kv_transfer_params`` (``remote_host``/``remote_port``) point at.

Faults that are honest with NIXL on TCP loopback:

* ``kill`` P *after the handshake, before the READ* (:meth:`NixlPair.fault_after_handshake`
  or a warm D): the READ post raises ``nixlRemoteDisconnectError`` at once;
* ``freeze`` P (SIGSTOP) after the handshake: the READ sits in ``PROC``; upstream D has no
  deadline for it and waits forever, kvfail's connector fails it at ``kvfail_deadline_s``;
* a wrong side-channel port (:func:`wrong_port`): zmq silently retries a refused connect,
  the handshake fails at its 5 s ``RCVTIMEO``;
* a wrong engine id (:func:`unknown_engine`): P answers the handshake for another engine;
* bad handshake metadata (:meth:`NixlPair.serve_bad_metadata`): P's real side channel
  answers with a payload whose NIXL agent bytes are garbled, or whose KV layout is not
  D's; D's handshake fails (NIXL's ``loadRemoteMD`` / upstream's layout check);
* a failed done-notification (:meth:`NixlPair.break_notifications`, D side, at the
  transport boundary): D's real READ is posted without its notification, and an explicit
  ``send_notif`` raises, so P is never told; the KV D pulled is good. P then holds the
  blocks until its send lease ends (:meth:`NixlPair.expire_leases` ends it now);
* :meth:`NixlPair.restart_p` replaces P (new process, new port).

The nixl teardown segfault: a process holding D engines must end with ``os._exit``, which
:func:`~kvfail.peers.nixl_exit_guard.install_exit_guard` (called when the first D is built)
sees to.

D's verification: D's forward hook runs when a request is first scheduled after its load
(where a real model would read the pulled KV) and compares every pulled token of every
layer with :mod:`kvfail.peers.pattern`; :meth:`NixlPair.verify` returns that result.
Layouts. ``tp_size=2`` runs P and D both at TP 2, each rank its own process in a real
gloo world (``tp_mode="processes"``, :mod:`kvfail.harness.ranks`): P's scheduler process
serves every rank's handshake metadata on its one side-channel port, keyed
``(0, tp_rank)`` as the engine core keys it; D's rank ``r`` handshakes for and READs P's
rank ``r``; the byte pattern and its check follow each rank's head shard. Whatever touches
a NIXL worker then runs on the rank (``Worker.call``): P's notification record and lease expiry, D's
handshake probe (:meth:`NixlPair.handshaked`) and its notification faults
(:class:`RankNotificationFaults`). :meth:`~kvfail.peers.base.PeerPair.signal_p_rank`
breaks one P rank only. Each rank process's NIXL worker pins it to one core; the pair
undoes that on every rank, as it does here.
``p_tp_size`` runs P at another TP size than D (heterogeneous TP): P's params name its
TP size, and D's ranks handshake with and READ from the P ranks upstream's topology maps
them to (at P TP 2 with D TP 1, D's one rank READs a head from each P rank; at P TP 1 with
D TP 2, each D rank READs its half of P's heads); the byte pattern follows the model's
global KV heads (:mod:`kvfail.peers.pattern`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvfail import compat
from kvfail.peers.base import (
    PeerPair,
    closed_port,
    unknown_engine,
    with_param,
)
from kvfail.peers.decode_record import DecodeRecord
from kvfail.peers.nixl_exit_guard import install_exit_guard
from kvfail.peers.nixl_notify_faults import (
    NotificationFaults,
    NotifyFaultAgent,
    RankNotificationFaults,
)
from kvfail.peers.nixl_producer import (
    BAD_METADATA,
    PREFIX,
    _unpin,
    restore_affinity,
)
from kvfail.peers.producer_handle import ProducerHandleBase, repo_pythonpath
from kvfail.peers.stuck_evidence import tracker_state
from kvfail.rig.ports import free_port

if TYPE_CHECKING:
    from kvfail.faults.netns import NamespaceHost
    from kvfail.harness import Engine, RunResult
    from kvfail.harness.hooks import RankView

__all__ = [
    "BAD_METADATA",
    "NIXL_ENV",
    "DecodeRecord",
    "NixlPair",
    "NixlProducerHandle",
    "nixl_available",
    "unknown_engine",
    "wrong_port",
]

#: Environment every NIXL engine process needs; each also gets its own side-channel port.
NIXL_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    # An agent's progress thread sleeps 100 µs between polls instead of taking a core
    # (kvfail.rig.nixl_progress; bench.nixl_progress measures it).
    "KVFAIL_NIXL_PTHR_DELAY_US": "100",
}
#: How long upstream's handshake waits for P's answer (zmq ``RCVTIMEO``, hard-coded).
HANDSHAKE_TIMEOUT_S = 5.0


def nixl_available() -> str | None:
    """None when a real NIXL worker can be built here, else the reason it cannot."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # ImportError, or a missing native library
        return f"nixl not importable: {type(exc).__name__}: {exc}"
    return None


def wrong_port(params: Mapping[str, Any], port: int | None = None) -> dict[str, Any]:
    """``params`` with a side-channel port nobody listens on (handshake times out, 5 s)."""
    return with_param(params, "remote_port", port or closed_port())


# --------------------------------------------------------------------------- P handle


class NixlProducerHandle(ProducerHandleBase):
    """The P process and its line protocol (see :mod:`kvfail.peers.nixl_producer`)."""

    prefix = PREFIX
    ready_key = "engine_id"

    module = "kvfail.peers.nixl_producer"
    transport = "nixl"
    port_env = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    default_connector = "NixlConnector"

    def _base_env(self) -> dict[str, str]:
        return {**NIXL_ENV, "PYTHONPATH": repo_pythonpath()}

    def serve_bad_metadata(self, kind: str | None) -> int:
        """Arm (``kind``, one of :data:`BAD_METADATA`) or disarm (None) P's bad handshake
        answers; returns how many bad answers P gave since it was last armed."""
        fault = {"fault": "bad_metadata", "kind": kind} if kind else {"fault": "none"}
        return int(self.request({"cmd": "inject", **fault})["served"])

    def expire(self, req_ids: Iterable[str]) -> dict[str, Any]:
        """End P's send lease of ``req_ids`` now (see the producer's ``expire``)."""
        return self.request({"cmd": "expire", "req_ids": list(req_ids)})


# --------------------------------------------------------------------------- D side
# Module-level: ``Worker.call`` pickles them by reference into a D rank process.


def _load_state(view: RankView, req_id: str) -> str:
    """One D rank's NIXL worker state for ``req_id``: evidence for a stuck load."""
    w: Any = getattr(view.connector, "connector_worker", None)
    if w is None:
        return "no NIXL worker"
    parts: list[str] = []
    meta = w._recving_metadata.get(req_id)
    remote = getattr(getattr(meta, "remote", None), "engine_id", None)
    parts.append("no metadata" if meta is None else f"metadata (P {remote})")
    states = []
    for handle in w._recving_transfers.get(req_id, ()):
        try:
            states.append(str(w.nixl_wrapper.check_xfer_state(handle)))
        except Exception as exc:
            states.append(f"check raised {exc!r}")
    parts.append(f"handles {states}")
    if remote is not None:
        parts.append(f"P agents {len(w._remote_agents.get(remote, {}))}")
        parts.append(f"handshake pending {remote in w._handshake_futures}")
    parts.append(f"ready queue {w._ready_requests.qsize()}")
    if compat.nixl_failed_set_available():  # a vLLM without it has nothing to show
        parts.append(f"failed {req_id in w._recv_failures}")
    tracked = tracker_state(w, req_id)
    return ", ".join(parts if tracked is None else [*parts, tracked])


def _has_remote_agent(view: RankView, engine_id: str) -> bool:
    nixl_worker = getattr(view.connector, "connector_worker", None)
    agents = getattr(nixl_worker, "_remote_agents", {})
    return bool(agents.get(engine_id))


class NixlPair(PeerPair):
    """P (subprocess) + D engines (this process), real NIXL pull connectors on both sides.

    ``connector``/``connector_module`` pick D's connector (upstream ``NixlConnector``, or
    ``KvfailNixlConnector`` from ``connectors.nixl``); P runs ``p_connector`` (default
    upstream's: a D-side test must not depend on kvfail's P). Always :meth:`close` (or use
    ``with``): it closes every D engine and P's whole process group.
    """

    load_state = staticmethod(_load_state)
    transport = "nixl"
    #: How long a SIGKILLed P may take to be reaped. The signal is already delivered, so a
    #: longer bound only waits, it hides nothing; tearing down a NIXL/UCX vLLM process can
    #: take tens of seconds on a loaded machine, and the scenario needs P gone
    #: (its sockets closed) before it goes on.
    kill_timeout_s = 120.0

    def __init__(
        self,
        *,
        policy: str = "fail",
        connector: str = "NixlConnector",
        connector_module: str | None = None,
        p_connector: str = "NixlConnector",
        p_connector_module: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        ready_timeout_s: float = 240.0,
        num_blocks: int = 64,
        build_default_consumer: bool = True,
        tp_size: int = 1,
        p_tp_size: int | None = None,
        num_kv_cache_groups: int = 1,
        producer: NixlProducerHandle | None = None,
        host: NamespaceHost | None = None,
    ) -> None:
        """``producer``: a running P (started with the same P settings) to pull from
        instead of starting one; this pair then does not close it. ``host``: run P on
        that simulated host (see :mod:`kvfail.faults.netns`)."""
        reason = nixl_available()
        if reason is not None:
            raise RuntimeError(reason)
        self._init_pair(
            connector=connector,
            connector_module=connector_module,
            extra_config=dict(extra_config or {}),
            p_kwargs={
                "connector": p_connector,
                "connector_module": p_connector_module,
            },
            p_tp_size=p_tp_size,
            env=NIXL_ENV,
            num_blocks=num_blocks,
            ready_timeout_s=ready_timeout_s,
            tp_size=tp_size,
            num_kv_cache_groups=num_kv_cache_groups,
            host=host,
        )
        #: Rank-side notification faults by D engine (``id``), refreshed by :meth:`observe`.
        self._rank_faults: dict[int, RankNotificationFaults] = {}
        self._start(producer, policy, build_default_consumer=build_default_consumer)

    # ------------------------------------------------------------------ engines

    def consumer(
        self,
        policy: str = "fail",
        *,
        name: str | None = None,
        connector: str | None = None,
        connector_module: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ) -> Engine:
        """The D engine called ``name`` (default: the policy's name), built on first use.

        Each D gets its own side-channel port (read from the environment when its
        scheduler connector is built) and its own nixl agent; a fresh name is a D that
        never talked to P ("cold"). ``connector``/``extra_config`` override the pair's.
        """
        key = name or policy
        if key in self.decoders:
            return self.decoders[key]
        from kvfail.harness import Engine

        install_exit_guard()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        spec = self._d_spec(
            key, policy, extra_config, connector=connector, connector_module=connector_module
        )
        mask = os.sched_getaffinity(0)
        with self._d_address():
            engine = Engine(spec, forward=self.check_forward)
        if spec.tp_mode == "processes":
            for worker in engine.workers:  # each rank's NIXL worker pinned its process
                worker.call(_unpin, mask)
        restore_affinity(mask)  # vLLM's CPU worker pinned this process to one core
        return self._register(key, engine)

    def _new_producer(self) -> NixlProducerHandle:
        """A fresh P (own side-channel port and engine id), spawned, not waited for."""
        return NixlProducerHandle(**self._p_kwargs)

    # ------------------------------------------------------------------ requests

    def handshaked(self, engine: Engine, producer: NixlProducerHandle | None = None) -> bool:
        """Every D worker of ``engine`` holds the remote agent of ``producer`` (default:
        P) (the handshake is done)."""
        producer = self.p if producer is None else producer
        if producer is None:
            return False
        return all(w.call(_has_remote_agent, producer.engine_id) for w in engine.workers)

    def fault_after_handshake(
        self,
        req_id: str,
        fault: str,
        *,
        consumer: str | Engine | None = None,
        timeout_s: float = 15.0,
        producer: NixlProducerHandle | None = None,
    ) -> bool:
        """Kill (``"kill"``) or stop (``"freeze"``) P (or ``producer``, e.g. the
        :meth:`~kvfail.peers.base.PeerPair.second_p`) after D's handshake with it,
        before its READ.

        Call right after :meth:`add`. If D has not handshaked with it yet, D is stepped
        once (which schedules the load; upstream handshakes in a background thread and
        posts the READ in a later step) and this waits, without stepping, until the
        handshake is done. The request's clock restarts at the injection. Returns
        whether the handshake was seen before the fault (False: it was injected anyway
        after ``timeout_s``, so the fault hit the handshake instead).
        """
        if fault not in ("kill", "freeze"):
            raise ValueError(f"unknown fault {fault!r}: kill | freeze")
        engine = self._engine(consumer)
        target = self._ready_producer() if producer is None else producer
        seen = True
        if not self.handshaked(engine, target):
            engine.step()
            self.observe(engine)
            end = time.monotonic() + timeout_s
            while not self.handshaked(engine, target) and time.monotonic() < end:
                time.sleep(0.005)
            seen = self.handshaked(engine, target)
        if fault == "kill":
            target.process.kill(timeout_s=self.kill_timeout_s)
        else:
            target.process.freeze()
        rec = self.records.get(req_id)
        if rec is not None:
            rec.injected_at = time.monotonic()
            rec.steps_at_injection = engine.record.steps
        return seen

    def serve_bad_metadata(self, kind: str | None) -> int:
        """P's side channel answers every handshake with metadata D cannot use (``kind``:
        ``garbled`` agent bytes, or a ``layout`` unlike D's; see :data:`BAD_METADATA`)
        until called with None. Only a D that has not handshaked with P yet (a cold one)
        asks. Returns how many bad answers P gave since it was last armed."""
        return self.producer().serve_bad_metadata(kind)

    def expire_leases(self, req_ids: Iterable[str]) -> dict[str, Any]:
        """End P's send lease of these P request ids now, as ``kv_lease_duration`` would
        later: frees P's blocks for pulls that will never notify P. The reply says which
        leases were still ``pending`` and which requests P was ``notified`` of."""
        return self.producer().expire(req_ids)

    def break_notifications(
        self, consumer: str | Engine | None = None
    ) -> NotificationFaults | RankNotificationFaults:
        """D's done-notifications to P fail for the P request ids armed on the returned
        :class:`NotificationFaults` (one per D engine; installed on each of its workers'
        NIXL agents on first use); a :class:`RankNotificationFaults` when D's ranks are
        processes (installed and armed on every rank)."""
        engine = self._engine(consumer)
        if engine.workers[0].remote:
            remote = self._rank_faults.get(id(engine))
            if remote is None:
                remote = self._rank_faults[id(engine)] = RankNotificationFaults(engine)
            return remote
        agents = [w.connector.connector_worker for w in engine.workers]
        for agent in agents:
            if isinstance(agent.nixl_wrapper, NotifyFaultAgent):
                found: NotificationFaults = agent.nixl_wrapper.kvfail_notify_faults
                return found
        faults = NotificationFaults()
        for nixl_worker in agents:
            nixl_worker.nixl_wrapper = NotifyFaultAgent(nixl_worker.nixl_wrapper, faults)
        return faults

    def run(
        self,
        req_ids: Iterable[str] | None = None,
        *,
        consumer: str | Engine | None = None,
        timeout_s: float = 30.0,
        poll_s: float = 0.005,
    ) -> RunResult:
        """Step D until these requests (default: all of its) are gone; bounded by
        ``timeout_s``, never raises for a crash (``reason="crash"``). Stamps each
        request's detection time (:attr:`DecodeRecord.reported_s`) and failure flag."""
        engine = self._engine(consumer)
        wanted = set(engine.requests) if req_ids is None else set(req_ids)

        def done(e: Engine) -> bool:
            self.observe(e)
            return not (wanted & set(e.scheduler.requests))

        return engine.run_until(done, max_steps=10**9, timeout_s=timeout_s, poll_s=poll_s)

    def observe(self, engine: Engine) -> None:
        """As the base; then refresh the rank-side notification faults armed on it."""
        super().observe(engine)
        remote = self._rank_faults.get(id(engine))
        if remote is not None and remote.armed:
            remote.refresh()

    # ------------------------------------------------------------------ faults

    def _close_extra(self) -> None:
        self.d = None
        self._rank_faults.clear()

    def __enter__(self) -> NixlPair:
        return self
