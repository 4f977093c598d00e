"""A real Mooncake P/D pair: P in its own OS process, D in this one, both on 127.0.0.1.

Why: the conformance suite must see what a *real* transport reports when the peer dies,
hangs or is misaddressed, through vLLM's real scheduler. :class:`MooncakePair` starts P
(:mod:`kvfail.peers.producer`) as a :class:`~kvfail.rig.processes.PeerProcess`, builds D as a
harness :class:`~kvfail.harness.Engine` here (so the oracles read D's real scheduler), and
exposes the faults that are honest with Mooncake on TCP loopback:

* ``kill_p`` / ``freeze_p`` / ``thaw_p``: process faults on P's whole process group;
* :func:`refused_bootstrap` (a closed port: connection refused, the "bootstrap down" case),
  :func:`unknown_engine` (P answers, but not for this engine id) and
  :meth:`MooncakePair.bootstrap_proxy` (a :class:`~kvfail.faults.FaultProxy` in front of
  P's bootstrap HTTP server: reset, blackhole, delay, refuse).

What can be proxied, and what cannot. D reaches P three ways: (1) the bootstrap HTTP
``GET /query`` at ``remote_bootstrap_addr``, which D takes from ``kv_transfer_params``, so
it can go through a proxy; (2) the ZMQ side channel, whose ``tcp://host:port`` D learns
*from the bootstrap answer* (P registered its own port), so a proxy would have to rewrite
the JSON body: not done; (3) the data, which P *pushes* into D with its transfer engine to
D's RPC port, which P learns from D's ZMQ message: also not proxied. So only the bootstrap
leg is proxied; a dead or silent data path is produced with ``kill_p`` / ``freeze_p``.

D's verification. D's forward hook runs when a request is first scheduled after its load
(the step where a real model would read the pulled KV) and compares every pulled token
position of every layer with :mod:`kvfail.peers.pattern`; :meth:`MooncakePair.verify`
returns that result. It is taken then, because D's blocks are freed when the request ends.

Layouts. ``tp_size=2`` runs P and D both at TP 2, each rank its own process in a real
gloo world (``tp_mode="processes"``): D's rank ``r`` pulls its head shard from P's rank
``r``, the byte pattern follows each rank's head shard, and
:meth:`~kvfail.peers.base.PeerPair.signal_p_rank` or ``inject(..., ranks=[r])`` breaks one
rank only. ``num_kv_cache_groups=2`` builds both
sides with two KV-cache groups (layer ``i`` in group ``i % 2``). ``p_tp_size`` runs P at
another TP size than D (heterogeneous TP): D's ranks tell P their TP size in the transfer
request and P's ranks plan which part of their heads goes to which D rank, as upstream's
connector does between real engines; the byte pattern follows the model's global KV
heads (:mod:`kvfail.peers.pattern`), so a head written to the wrong D rank fails the check.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvfail.faults import FaultProxy
from kvfail.peers.base import (
    DecodeRecord,
    PeerPair,
    closed_port,
    unknown_engine,
    with_param,
)
from kvfail.peers.producer import DEFAULT_EXTRA_CONFIG, P_PEER_CACHE_ENV, PREFIX
from kvfail.peers.producer_handle import ProducerHandleBase
from kvfail.peers.stuck_evidence import tracker_state

if TYPE_CHECKING:
    from kvfail.faults.netns import NamespaceHost
    from kvfail.harness import Engine, RunResult

__all__ = [
    "MOONCAKE_ENV",
    "P_PEER_CACHE_ENV",
    "DecodeRecord",
    "MooncakePair",
    "ProducerHandle",
    "mooncake_available",
    "p_peer_cache_env",
    "refused_bootstrap",
    "unknown_engine",
]

#: Environment every Mooncake engine process needs (P gets it plus its bootstrap port).
MOONCAKE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "MC_LOG_LEVEL": "ERROR",
}


def p_peer_cache_env() -> dict[str, str]:
    """:data:`P_PEER_CACHE_ENV`, each key's value from the environment where it is set."""
    return {key: os.environ.get(key, value) for key, value in P_PEER_CACHE_ENV.items()}


def mooncake_available() -> str | None:
    """None when a real Mooncake worker can be built here, else the reason it cannot."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or a missing native library (libibverbs)
        return f"mooncake.engine not importable: {type(exc).__name__}: {exc}"
    return None


def refused_bootstrap(params: Mapping[str, Any], port: int | None = None) -> dict[str, Any]:
    """``params`` with a bootstrap address where nothing listens (connection refused)."""
    return with_param(params, "remote_bootstrap_addr", f"http://127.0.0.1:{port or closed_port()}")


# --------------------------------------------------------------------------- P handle


class ProducerHandle(ProducerHandleBase):
    """The P process and its line protocol (see :mod:`kvfail.peers.producer`)."""

    prefix = PREFIX
    ready_key = "bootstrap_addr"

    module = "kvfail.peers.producer"
    transport = "mooncake"
    port_env = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
    default_connector = "MooncakeConnector"

    def _base_env(self) -> dict[str, str]:
        return {**MOONCAKE_ENV, **p_peer_cache_env()}

    @property
    def bootstrap_port(self) -> int:
        return self.port

    @property
    def bootstrap_addr(self) -> str:
        return f"http://{self.address}:{self.bootstrap_port}"

    def prefill(
        self,
        req_id: str,
        prompt_len: int,
        prompt_seed: str,
        transfer_id: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """As :meth:`ProducerHandleBase.prefill`; Mooncake's P also takes the exchange's
        ``transfer_id`` (default: one made from ``req_id``)."""
        return super().prefill(
            req_id, prompt_len, prompt_seed, transfer_id=transfer_id or f"xfer-{req_id}", **fields
        )

    def inject(
        self,
        req_id: str,
        fault: str,
        timeout_s: float = 10.0,
        *,
        ranks: Iterable[int] | None = None,
        delay_s: float | None = None,
    ) -> dict[str, Any]:
        """Arm a fault for D's next pull naming ``req_id`` (see the producer), on every
        P rank or only on ``ranks``; ``delay_s`` is how long a ``delay`` fault holds it."""
        cmd: dict[str, Any] = {"cmd": "inject", "req_id": req_id, "fault": fault}
        if delay_s is not None:
            cmd["delay_s"] = delay_s
        if ranks is not None:
            cmd["ranks"] = list(ranks)
        return self.request(cmd, timeout_s)

    def release(self, req_id: str, timeout_s: float = 10.0) -> None:
        """Let a held ``delay`` or ``shutdown_mid_write`` write of ``req_id`` go now."""
        reply = self.request({"cmd": "release", "req_id": req_id}, timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"P could not release {req_id}: {reply}")

    def late_pushes(self, timeout_s: float = 10.0) -> dict[str, dict[str, list[int]]]:
        """The ``delay`` pulls P served so far: ``{"pushed": {req: [ranks]}, "written":
        {req: [ranks]}}`` (the ranks whose push ran / wrote into D's blocks)."""
        reply = self.request({"cmd": "late_pushes"}, timeout_s)
        return {"pushed": dict(reply["pushed"]), "written": dict(reply["written"])}


# --------------------------------------------------------------------------- D side


def _load_state(view: Any, req_id: str) -> str:
    """One D rank's Mooncake worker state for ``req_id``: evidence for a stuck load."""
    w: Any = getattr(view.connector, "connector_worker", None)
    if w is None:
        return "no Mooncake worker"
    parts = [
        f"finished recving {req_id in getattr(w, 'finished_recving_reqs', ())}",
        f"bootstrap queries pending {len(getattr(w, '_pending_bootstrap_queries', {}))}",
    ]
    tasks = getattr(w, "_mc_tasks", None)
    if tasks is not None:  # kvfail's worker: its pull tasks for this request
        mine = list(tasks.get(req_id, ()))
        parts.append(f"pull tasks {len(mine)} ({sum(t.done() for t in mine)} done)")
    tracked = tracker_state(w, req_id)
    return ", ".join(parts if tracked is None else [*parts, tracked])


class MooncakePair(PeerPair):
    """P (subprocess) + D (this process), real ``MooncakeConnector`` on both sides.

    ``connector``/``connector_module`` apply to both sides unless ``p_connector`` /
    ``p_connector_module`` are given. ``abort_request_timeout_s`` sets
    ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` for P and, if unset, for this process (D's
    socket timeout is that + 60 s, hard-coded upstream); ``p_abort_request_timeout_s``
    sets P's alone (how long P keeps a prefilled request no D pulled), leaving this
    process's environment as every other pair in it has it. Always :meth:`close` (or use
    ``with``): it closes every D engine and P's whole process group.
    """

    load_state = staticmethod(_load_state)

    transport = "mooncake"

    def __init__(
        self,
        *,
        policy: str = "fail",
        connector: str = "MooncakeConnector",
        connector_module: str | None = None,
        p_connector: str | None = None,
        p_connector_module: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        p_extra_config: Mapping[str, Any] | None = None,
        tp_size: int = 1,
        p_tp_size: int | None = None,
        num_kv_cache_groups: int = 1,
        abort_request_timeout_s: int = 5,
        p_abort_request_timeout_s: int | None = None,
        ready_timeout_s: float = 240.0,
        num_blocks: int = 64,
        producer: ProducerHandle | None = None,
        host: NamespaceHost | None = None,
    ) -> None:
        reason = mooncake_available()
        if reason is not None:
            raise RuntimeError(reason)
        self._init_pair(
            connector=connector,
            connector_module=connector_module,
            extra_config={**DEFAULT_EXTRA_CONFIG, **dict(extra_config or {})},
            p_kwargs={
                "connector": p_connector or connector,
                "connector_module": (
                    p_connector_module if p_connector is not None else connector_module
                ),
                "extra_config": dict(p_extra_config or {}),
                "env": {
                    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(
                        p_abort_request_timeout_s or abort_request_timeout_s
                    )
                },
            },
            p_tp_size=p_tp_size,
            env={
                **MOONCAKE_ENV,
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(abort_request_timeout_s),
            },
            num_blocks=num_blocks,
            ready_timeout_s=ready_timeout_s,
            tp_size=tp_size,
            num_kv_cache_groups=num_kv_cache_groups,
            host=host,
        )
        self._proxies: list[FaultProxy] = []
        self._start(producer, policy)

    # ------------------------------------------------------------------ engines

    def consumer(
        self,
        policy: str = "fail",
        *,
        name: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ) -> Engine:
        """The D engine called ``name`` (default: the policy's name), built on first use.

        Several D engines can share one P. A fresh name gives a D that never talked to P
        ("cold"): Mooncake queries the bootstrap server only for engine ids it has not seen.
        ``extra_config`` adds to the pair's for this D.
        """
        key = name or policy
        if key in self.decoders:
            return self.decoders[key]
        from kvfail.harness import Engine
        from kvfail.rig.cpu_shim import cpu_accelerator_index_shim

        spec = self._d_spec(key, policy, extra_config)
        with cpu_accelerator_index_shim(), self._d_address():
            engine = Engine(spec, forward=self.check_forward)
        return self._register(key, engine)

    def _new_producer(self) -> ProducerHandle:
        """A fresh P (own bootstrap port and engine id), spawned, not waited for."""
        return ProducerHandle(**self._p_kwargs)

    @property
    def p_kwargs(self) -> dict[str, Any]:
        """What P is started with (a key for sharing one P between pairs)."""
        return dict(self._p_kwargs)

    def inject(
        self,
        req_id: str,
        fault: str,
        *,
        ranks: Iterable[int] | None = None,
        delay_s: float | None = None,
    ) -> None:
        """P answers D's next pull of ``req_id`` with ``fault`` (``INJECTABLE``), on
        every P rank or only on ``ranks`` (a ``delay`` fault: ``delay_s`` late)."""
        self.producer().inject(req_id, fault, ranks=ranks, delay_s=delay_s)

    # ------------------------------------------------------------------ requests

    def run(
        self,
        req_ids: Iterable[str] | None = None,
        *,
        consumer: str | None = None,
        consumers: Iterable[str] | None = None,
        timeout_s: float = 30.0,
        poll_s: float = 0.005,
    ) -> RunResult:
        """Step D engines until these requests (default: all of theirs) are gone.

        ``consumers`` steps several D engines round-robin, as concurrent engines would run:
        Mooncake starts a pull only in D's worker step, so an engine not stepped has not
        started its pull and its detection clock would be wrong. Bounded by ``timeout_s``;
        never raises for a crash (``reason="crash"``). Stamps each request's detection
        time (:attr:`DecodeRecord.reported_s`) and failure flag.
        """
        from kvfail.harness import RunResult

        names = [consumer] if consumers is None else list(consumers)
        engines = [self._engine(name) for name in names]
        wanted = {rid for e in engines for rid in e.requests} if req_ids is None else set(req_ids)
        for engine in engines:  # from now on: reports before the run are not this run's
            self._seen[engine] = len(engine.record.kv_reports)
        start = time.monotonic()
        steps = 0
        while True:
            for engine in engines:
                self.observe(engine)
            if any(e.crashed is not None for e in engines):
                return RunResult(False, "crash", steps, time.monotonic() - start)
            if not any(wanted & set(e.scheduler.requests) for e in engines):
                return RunResult(True, "predicate", steps, time.monotonic() - start)
            if time.monotonic() - start >= timeout_s:
                return RunResult(False, "timeout", steps, time.monotonic() - start)
            for engine in engines:
                engine.step()
            steps += 1
            if poll_s > 0:
                time.sleep(poll_s)

    # ------------------------------------------------------------------ faults

    def bootstrap_proxy(self) -> FaultProxy:
        """A started :class:`FaultProxy` in front of P's bootstrap server (closed by
        :meth:`close`); use :meth:`via_proxy` on params to route D's query through it."""
        proxy = FaultProxy(self.producer().bootstrap_port, name="mooncake-bootstrap").start()
        self._proxies.append(proxy)
        return proxy

    @staticmethod
    def via_proxy(params: Mapping[str, Any], proxy: FaultProxy) -> dict[str, Any]:
        return refused_bootstrap(params, proxy.port)

    # ------------------------------------------------------------------ teardown

    def _close_extra(self) -> None:
        for proxy in self._proxies:
            with contextlib.suppress(Exception):
                proxy.close()
        self._proxies.clear()

    def __enter__(self) -> MooncakePair:
        return self
