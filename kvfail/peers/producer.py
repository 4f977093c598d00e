"""A real Mooncake PRODUCER (P) engine in its own OS process, driven over stdin/stdout.

Why a process: a fault on P must be a real one (SIGKILL closes its sockets, SIGSTOP keeps
them open and silent), and only a separate OS process gives that. P is the harness
:class:`~kvfail.harness.Engine` (vLLM's real ``Scheduler`` + a real WORKER-role Mooncake
connector on CPU/TCP), whose forward writes :mod:`kvfail.peers.pattern` into the request's
KV blocks, so D can check every byte it received.

Run: ``python -m kvfail.peers.producer --config '<json>'``. Config keys (all optional):
``connector`` (default ``MooncakeConnector``), ``connector_module`` (None = registered in
vLLM; e.g. ``connectors.mooncake``), ``engine_id``, ``extra_config`` (merged over
``{"mooncake_protocol": "tcp", "num_workers": 2}``), ``num_blocks``, ``tp_size`` (> 1: one
process per rank, pids in the ready event's ``rank_pids``), ``num_kv_cache_groups``. The
bootstrap port
comes from ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (set by the parent), the host from
``VLLM_HOST_IP`` (127.0.0.1 unless P runs on a simulated host).

Protocol: one JSON object per line. Commands on stdin, each with an optional ``id`` that
the reply echoes:

* ``{"cmd": "prefill", "req_id", "prompt_seed", "prompt_len", "transfer_id"?}`` runs the P
  request (``do_remote_decode``, ``max_tokens=1``) until it finishes and replies with the
  ``kv_transfer_params`` D needs;
* ``{"cmd": "prefill_batch", "requests": [{"req_id", "prompt_seed", "prompt_len",
  "transfer_id"?}, ...]}``: the same for every request at once (P steps until all are
  prefilled), replying ``kv_transfer_params`` by request id;
* ``{"cmd": "inject", "fault", "req_id", "ranks"?}``: P answers D's next pull naming
  ``req_id`` wrongly on purpose (:data:`INJECTABLE`), on every rank or only ``ranks``:
  ``error_response`` (an ERROR reply to the whole pull), ``err_reqs`` (``err_reqs``
  naming the armed requests, the rest of the pull served) or ``finish_without_result``
  (FINISH naming no request), moving no data for the armed requests; or
  ``die_mid_transfer``: write the first half of the pull into D, then SIGKILL itself;
  or ``delay`` (with ``delay_s``): a slow but live P, which holds the pull until the
  driver lets it go (``release``), at most ``delay_s``, then serves it for real (its
  other sender tasks and its engine go on; its own expiry of the request is held off
  meanwhile, as for a send under way); or ``shutdown_mid_write`` (with ``delay_s``):
  when the write for the pull starts, this rank's connector worker is shut down
  (upstream's ``shutdown``, what vLLM calls on a worker that exits: the side channel
  closes at once, the sender threads are left to finish), and the write itself is held
  the same way. One-shot;
* ``{"cmd": "release", "req_id"}``: a held ``delay`` or ``shutdown_mid_write`` write of
  ``req_id`` goes ahead now, on every rank (one released before its pull arrives is not
  held). Why a release and not a clock: the scenario lets the write land once D has
  given the load up, so no verdict turns on which of P's timer and D's deadline fired
  first on a loaded machine;
* ``{"cmd": "late_pushes"}``: the ``delay`` and ``shutdown_mid_write`` pulls served so
  far, per request: the ranks whose push ran, and the ranks whose push wrote
  (``{"pushed": {req: [ranks]}, "written": {req: [ranks]}}``), so a driver knows when a
  slow P's write has landed;
* ``{"cmd": "stats"}``: counters and the engine's pending sends;
* ``{"cmd": "quit"}``: close the engine and exit with ``os._exit(0)``.

Replies and events go to the *original* stdout, each line prefixed with :data:`PREFIX`;
the process's fd 1 is pointed at stderr before vLLM is imported, so library prints
(Mooncake, vLLM's logger) can never corrupt the channel. Between commands P keeps stepping
its engine, which is what serves D's pull and reports ``finished_sending``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.peers.producer_engine import ProducerEngine, pattern_forward, producer_spec
from kvfail.peers.protocol import Channel, Handler, serve

if TYPE_CHECKING:
    from kvfail.harness.hooks import RankView

__all__ = [
    "DEFAULT_EXTRA_CONFIG",
    "INJECTABLE",
    "PREFIX",
    "P_PEER_CACHE_ENV",
    "WRITE_RETRIES",
    "main",
]

#: Every protocol line starts with this, so a reader can ignore anything else.
PREFIX = "@@kvfail-p "
DEFAULT_EXTRA_CONFIG: dict[str, Any] = {"mooncake_protocol": "tcp", "num_workers": 2}
_IDLE_SLEEP_S = 0.005
#: Protocol faults P can answer a pull with (``inject`` command).
INJECTABLE = (
    "error_response",
    "err_reqs",
    "finish_without_result",
    "die_mid_transfer",
    "delay",
    "shutdown_mid_write",
)


class _FaultInjectingSender:
    """Mixed in front of P's real Mooncake worker class (upstream's, or a subclass).

    Why a mixin and not a scripted fake P: D must see the fault from the real P process,
    through its real ZMQ side channel, after a real bootstrap, so only the reply itself is
    wrong. ``send_kv_to_decode`` is upstream's per-pull handler on P's sender loop; when a
    pull names an armed request it answers with the armed fault instead (and moves no
    data), otherwise it defers to the real one. The rest of P, including expiring the
    unpulled request after ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, is untouched.
    """

    kvfail_armed: dict[str, str]
    #: ``delay`` pulls served, by request: whether the push wrote (for ``late_pushes``).
    kvfail_late_pushes: dict[str, bool]

    async def send_kv_to_decode(self, identity: bytes, sock: Any, meta: Any) -> None:
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeXferResponse,
            MooncakeXferResponseStatus,
        )

        armed = getattr(self, "kvfail_armed", {})
        hit = [r for r in meta.req_blocks if r in armed]
        fault = armed.pop(hit[0]) if hit else None
        for rid in hit[1:]:
            armed.pop(rid, None)
        if fault == "delay":
            await self._kvfail_late_send(identity, sock, meta, hit)
            return
        if fault == "shutdown_mid_write":
            self.kvfail_shutdown_write = hit
            fault = None
        if fault is None or fault == "die_mid_transfer":
            self.kvfail_die_in_send = fault is not None
            await super().send_kv_to_decode(identity, sock, meta)  # type: ignore[misc]
            return
        if fault == "error_response":
            response = MooncakeXferResponse(
                status=MooncakeXferResponseStatus.ERROR, err_msg=f"kvfail injected {fault}"
            )
        elif fault == "err_reqs":
            # P names the armed requests failed; the rest of the same pull is served for
            # real after that (CONTINUE, then upstream's replies), as a P that failed
            # some of a batch's sends does.
            rest = {r: blocks for r, blocks in meta.req_blocks.items() if r not in hit}
            response = MooncakeXferResponse(
                status=(
                    MooncakeXferResponseStatus.CONTINUE
                    if rest
                    else MooncakeXferResponseStatus.FINISH
                ),
                err_reqs=hit,
                err_msg=f"kvfail injected {fault}",
            )
            if rest:
                await sock.send_multipart((identity, self._encoder.encode(response)))  # type: ignore[attr-defined]
                self.kvfail_die_in_send = False
                served = msgspec.structs.replace(meta, req_blocks=rest)
                await super().send_kv_to_decode(identity, sock, served)  # type: ignore[misc]
                return
        else:  # finish_without_result
            response = MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH)
        await sock.send_multipart((identity, self._encoder.encode(response)))  # type: ignore[attr-defined]

    async def _kvfail_late_send(
        self, identity: bytes, sock: Any, meta: Any, hit: list[str]
    ) -> None:
        """A slow P: the reply and the data come late, but they come.

        While it sleeps, the armed requests count as being sent (upstream's ``sending``),
        as they would for a P stuck inside its transfer: P's own expiry
        (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``) must not drop a push that is only late,
        or a delay close to it would make the fault vanish. Records, per request, whether
        the push wrote (upstream counts a send as ``sent`` only when it did)."""
        need_send = self.reqs_need_send  # type: ignore[attr-defined]
        metas = {r: need_send.get(meta.req_blocks[r][0]) for r in hit}
        held = [m for m in metas.values() if m is not None]
        sent = {r: (m.sent if m is not None else 0) for r, m in metas.items()}
        for m in held:
            m.sending += 1
        try:
            await asyncio.to_thread(self._kvfail_hold, hit)
            self.kvfail_die_in_send = False
            await super().send_kv_to_decode(identity, sock, meta)  # type: ignore[misc]
        finally:
            for m in held:
                m.sending -= 1
            for r, m in metas.items():
                self.kvfail_late_pushes[r] = m is not None and m.sent > sent[r]

    def _send_blocks(
        self, remote_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]
    ) -> int:
        """One write into D, retried once when it fails (see :data:`WRITE_RETRIES`).

        ``die_mid_transfer``: really write the first half of the pull into D, then
        SIGKILL this process (P, or this P rank at TP > 1) before the rest and before
        any reply: a peer that crashed with D's blocks half written.

        ``shutdown_mid_write``: with the write under way, this worker is shut down on
        another thread (vLLM's shutdown runs beside the sender), and the write lands once
        released (:meth:`_kvfail_hold`): the write a graceful shutdown leaves running."""
        args = (remote_session, src_ptrs, dst_ptrs, lengths)
        hit = self.__dict__.pop("kvfail_shutdown_write", None)
        if hit is not None:
            threading.Thread(target=self.shutdown, name="kvfail-p-shutdown", daemon=True).start()  # type: ignore[attr-defined]
            ret = self._kvfail_write(*args, held=hit)
            for r in hit:
                self.kvfail_late_pushes[r] = ret == 0
            return ret
        if not getattr(self, "kvfail_die_in_send", False):
            return self._kvfail_write(*args)
        half = max(1, len(src_ptrs) // 2)
        super()._send_blocks(remote_session, src_ptrs[:half], dst_ptrs[:half], lengths[:half])  # type: ignore[misc]
        os.kill(os.getpid(), signal.SIGKILL)
        return -1  # not reached

    def _kvfail_write(
        self,
        remote_session: str,
        src_ptrs: list[int],
        dst_ptrs: list[int],
        lengths: list[int],
        *,
        held: list[str] | None = None,
    ) -> int:
        """One write into D, under way (``stats``' ``oldest_write_s``) from its start,
        a hold for the ``held`` requests' release included, and retried when it fails
        (:data:`WRITE_RETRIES`)."""
        writing = self.__dict__.setdefault("kvfail_writing", {})
        writing[threading.get_ident()] = time.monotonic()
        try:
            if held:
                self._kvfail_hold(held)
            ret = int(super()._send_blocks(remote_session, src_ptrs, dst_ptrs, lengths))  # type: ignore[misc]
            for _ in range(WRITE_RETRIES):
                if ret == 0:
                    break
                self.kvfail_write_retries = getattr(self, "kvfail_write_retries", 0) + 1
                ret = int(super()._send_blocks(remote_session, src_ptrs, dst_ptrs, lengths))  # type: ignore[misc]
            return ret
        finally:
            writing.pop(threading.get_ident(), None)

    def _kvfail_hold(self, req_ids: list[str]) -> None:
        """Block until each of ``req_ids`` is released (``release``), or its cap (the
        ``delay_s`` it was armed with) has passed since the hold began."""
        started = time.monotonic()
        for req_id in req_ids:
            gate = _gate(self, req_id)
            gate.event.wait(max(0.0, gate.cap_s - (time.monotonic() - started)))
            self.__dict__["kvfail_gates"].pop(req_id, None)


def _make_injecting(worker: Any) -> None:
    """Re-class one built Mooncake worker so it can inject faults and retries a failed
    write once (see above). Every rank's worker gets it when P starts.

    The connector builds its worker itself (and building one starts a TransferEngine),
    so the built object is given a subclass of its own class; nothing is copied.
    """
    cls = type(worker)
    if isinstance(worker, _FaultInjectingSender):
        return
    worker.__class__ = type(f"FaultInjecting{cls.__name__}", (_FaultInjectingSender, cls), {})
    worker.kvfail_armed = {}
    worker.kvfail_late_pushes = {}


@dataclass
class _Gate:
    """What holds one request's late write: its release, and the longest it waits."""

    cap_s: float = 0.0
    event: threading.Event = field(default_factory=threading.Event)


def _gate(sender: Any, req_id: str) -> _Gate:
    gates: dict[str, _Gate] = sender.__dict__.setdefault("kvfail_gates", {})
    return gates.setdefault(req_id, _Gate())


def _arm(view: RankView, req_id: str, fault: str, delay_s: float = 0.0) -> bool:
    """On a rank: arm ``fault`` for ``req_id`` in its Mooncake sender (False: none)."""
    sender = getattr(view.connector, "connector_worker", None)
    if sender is None:
        return False
    _make_injecting(sender)
    sender.kvfail_armed[req_id] = fault
    if fault in ("delay", "shutdown_mid_write"):
        _gate(sender, req_id).cap_s = delay_s
    return True


def _release(view: RankView, req_id: str) -> bool:
    """On a rank: let ``req_id``'s held write go (False: this rank has no sender)."""
    sender = getattr(view.connector, "connector_worker", None)
    if sender is None:
        return False
    _gate(sender, req_id).event.set()
    return True


def _prepare_sender(view: RankView) -> bool:
    """On a rank at P's start: its Mooncake sender gets the rig's write handling (False:
    this rank has none)."""
    sender = getattr(view.connector, "connector_worker", None)
    if sender is None:
        return False
    _make_injecting(sender)
    return True


def _write_retries(view: RankView) -> int:
    """On a rank: the writes its sender retried (:data:`WRITE_RETRIES`)."""
    sender = getattr(view.connector, "connector_worker", None)
    return int(getattr(sender, "kvfail_write_retries", 0))


def _oldest_write_s(view: RankView) -> float | None:
    """On a rank: how long its oldest write into D still under way has taken (None: no
    write under way). A loopback write takes milliseconds; one that never returns is a
    wedged transfer engine (see :data:`P_PEER_CACHE_ENV`)."""
    sender = getattr(view.connector, "connector_worker", None)
    started = list(getattr(sender, "kvfail_writing", {}).values())
    return time.monotonic() - min(started) if started else None


def _late_pushes(view: RankView) -> dict[str, bool]:
    """On a rank: the ``delay`` pulls its sender served (request -> whether it wrote)."""
    sender = getattr(view.connector, "connector_worker", None)
    return dict(getattr(sender, "kvfail_late_pushes", None) or {})


#: Mooncake settings of the rig's P processes only (rig patch ``mooncake_p_peer_caches``,
#: :mod:`kvfail.rig.patches`): P looks each D's metadata up again for every write, and
#: keeps Mooncake's pooled connections. A value already in the environment wins, so a
#: user can run without it.
#:
#: The pool stays on although a pooled connection can outlive its D: with the pool off,
#: Mooncake starts each write's session on the calling thread, which then races the
#: transport's own thread on the session's progress timer. That race corrupted the
#: transport's timer queue in the suite's runs: its thread spun, and P never wrote again.
#: A write lost on a connection to an ended D is retried instead (:data:`WRITE_RETRIES`).
P_PEER_CACHE_ENV: dict[str, str] = {
    "MC_DISABLE_METACACHE": "1",
    "MC_TCP_ENABLE_CONNECTION_POOL": "1",
}
#: How often the rig's P writes again into D after a write failed. The suite builds a D
#: per scenario, each on random ports out of about 2,000, so P's pool soon holds a
#: connection to an ended D at a port a new one has; the first write on it fails, and the
#: next one, on a fresh connection, lands. Writing P's bytes twice to the same place is
#: harmless, and a write that fails twice is reported as upstream's P reports it.
WRITE_RETRIES = 1


def _record_peer_cache_settings() -> None:
    """Note the rig's Mooncake cache settings where they took effect (this P's engine)."""
    from kvfail.rig import patches as rig_patches

    applied = [
        f"{k}={os.environ[k]}" for k, v in P_PEER_CACHE_ENV.items() if os.environ.get(k) == v
    ]
    if applied:
        rig_patches.record("mooncake_p_peer_caches", ", ".join(applied))


class _Producer(ProducerEngine):
    def __init__(self, config: dict[str, Any], channel: Channel) -> None:
        from kvfail.harness import Engine
        from kvfail.rig.cpu_shim import cpu_accelerator_index_shim

        self.channel = channel
        extra = dict(DEFAULT_EXTRA_CONFIG)
        extra.update(config.get("extra_config") or {})
        self.engine_id = config.get("engine_id") or f"P-mooncake-{os.getpid()}"
        self.bootstrap_port = int(os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
        spec = producer_spec(
            config, connector="MooncakeConnector", engine_id=self.engine_id, extra_config=extra
        )
        self._seeds: dict[str, str] = {}
        #: The transfer id of each request being prefilled.
        self._transfer_ids: dict[str, str] = {}
        with cpu_accelerator_index_shim():
            self.engine = Engine(spec, forward=pattern_forward(self._seeds))
        for worker in self.engine.workers:
            worker.call(_prepare_sender)
        _record_peer_cache_settings()
        self.injected = 0
        self._init_counters()

    def bootstrap_addr(self) -> str:
        # VLLM_HOST_IP is the address P serves on: loopback, or a simulated host's own.
        return f"http://{os.environ.get('VLLM_HOST_IP', '127.0.0.1')}:{self.bootstrap_port}"

    def step_if_busy(self) -> bool:
        if self.engine.crashed is not None or self.engine.is_idle():
            return False
        self._step()
        return True

    def _start_prefill(self, req: Mapping[str, Any]) -> None:
        """P's request for D to pull, under ``transfer_id`` (default ``xfer-<req_id>``)."""
        req_id = str(req["req_id"])
        seed = str(req.get("prompt_seed") or req_id)
        transfer_id = str(req.get("transfer_id") or f"xfer-{req_id}")
        self._seeds[req_id] = seed
        self._transfer_ids[req_id] = transfer_id
        self.engine.add_request(
            req_id,
            prompt_len=int(req.get("prompt_len", 100)),
            prompt_seed=seed,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
        )

    def _prefilled(self, req_id: str) -> dict[str, Any] | str | None:
        """Once the request finished at its one token: the params naming P's bootstrap."""
        from vllm.v1.request import RequestStatus

        status = self.engine.requests[req_id].status
        if not RequestStatus.is_finished(status):
            return None
        if status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return f"P request ended {status.name}"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": self.bootstrap_addr(),
            "transfer_id": self._transfer_ids.pop(req_id),
        }

    def _prefill_step(self) -> None:
        self.step_if_busy()

    def inject(self, cmd: dict[str, Any]) -> dict[str, Any]:
        fault = str(cmd.get("fault"))
        if fault not in INJECTABLE:
            return {"ok": False, "error": f"unknown fault {fault!r}; one of {INJECTABLE}"}
        req_id = str(cmd["req_id"])
        ranks = cmd.get("ranks")
        workers = [w for w in self.engine.workers if ranks is None or w.rank in ranks]
        delay_s = float(cmd.get("delay_s", 0.0))
        armed = [w.rank for w in workers if w.call(_arm, req_id, fault, delay_s)]
        if not armed:
            return {"ok": False, "error": "P has no Mooncake worker to inject into"}
        self.injected += 1
        return {"ok": True, "fault": fault, "req_id": req_id, "ranks": armed}

    def release(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A held late write of ``req_id`` goes ahead now, on every rank."""
        req_id = str(cmd["req_id"])
        ranks = [w.rank for w in self.engine.workers if w.call(_release, req_id)]
        return {"ok": bool(ranks), "req_id": req_id, "ranks": ranks}

    def late_pushes(self) -> dict[str, Any]:
        """Per request, the ranks whose ``delay`` push ran and those whose push wrote."""
        pushed: dict[str, list[int]] = {}
        written: dict[str, list[int]] = {}
        for w in self.engine.workers:
            for req_id, wrote in w.call(_late_pushes).items():
                pushed.setdefault(req_id, []).append(w.rank)
                if wrote:
                    written.setdefault(req_id, []).append(w.rank)
        return {"ok": True, "pushed": pushed, "written": written}

    def stats(self) -> dict[str, Any]:
        return self._stats(
            injected=self.injected,
            write_retries=sum(w.call(_write_retries) for w in self.engine.workers),
            oldest_write_s=round(
                max((w.call(_oldest_write_s) or 0.0) for w in self.engine.workers), 3
            ),
        )

    def _own_commands(self) -> dict[str, Handler]:
        return {"release": self.release, "late_pushes": lambda _: self.late_pushes()}


def main(argv: list[str] | None = None) -> None:
    """Entry point; never returns (``os._exit``: native transports may crash at exit)."""
    serve(
        argv,
        doc=__doc__,
        prefix=PREFIX,
        build=_Producer,
        ready=lambda p: {
            "engine_id": p.engine_id,
            "bootstrap_addr": p.bootstrap_addr(),
            "rank_pids": [w.process.pid if w.process else os.getpid() for w in p.engine.workers],
        },
        idle=_idle,
    )


def _idle(producer: _Producer) -> None:
    if not producer.step_if_busy():
        time.sleep(_IDLE_SLEEP_S)


if __name__ == "__main__":
    main()
