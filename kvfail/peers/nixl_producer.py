"""A real NIXL PRODUCER (P) engine in its own OS process, driven over stdin/stdout.

Why a process: a fault on P must be a real one (SIGKILL makes UCX see the endpoint die,
SIGSTOP leaves it connected and silent), and only a separate OS process gives that. Also,
any process that created a nixl UCX agent segfaults at a normal interpreter exit, so P
always ends with ``os._exit``.

P is the harness :class:`~kvfail.harness.Engine`: vLLM's real ``Scheduler`` (whose
SCHEDULER-role NIXL connector serves the zmq side-channel handshake) and a real
WORKER-role NIXL pull connector (nixl agent, UCX over TCP loopback, DRAM KV tensors
registered with ``kv_buffer_device="cpu"``). Its forward writes :mod:`kvfail.peers.pattern`
into the request's KV blocks, so D can check every byte it pulled.

Run: ``python -m kvfail.peers.nixl_producer --config '<json>'``. Config keys (optional):
``connector`` (default ``NixlConnector``), ``connector_module`` (None = registered in
vLLM; ``connectors.nixl`` for kvfail's), ``engine_id``, ``extra_config``, ``num_blocks``,
``tp_size`` (> 1: one process per TP rank in a real gloo world, ``tp_mode="processes"``;
their pids are in the ready event's ``rank_pids``), ``num_kv_cache_groups``.
The side-channel host/port come from ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` (set by
the parent; 127.0.0.1 and a free port).

Protocol: one JSON object per line; commands on stdin, each with an ``id`` the reply
echoes; replies on the *original* stdout prefixed with :data:`PREFIX` (fd 1 is pointed at
stderr before vLLM is imported, because NIXL's Python logger writes to stdout):

* ``{"cmd": "prefill", "req_id", "prompt_seed", "prompt_len"}``: run P's request
  (``do_remote_decode``, ``max_tokens=1``) until it finishes; reply with the
  ``kv_transfer_params`` upstream's ``request_finished`` produced for D;
* ``{"cmd": "prefill_batch", "requests": [{"req_id", "prompt_seed", "prompt_len"}, ...]}``:
  the same for every request at once (P steps until all are prefilled), replying
  ``kv_transfer_params`` by request id;
* ``{"cmd": "inject", "fault": "bad_metadata", "kind"}``: from now on the side channel
  answers every handshake with metadata D cannot use (:data:`BAD_METADATA`): ``garbled``
  (the NIXL agent metadata bytes inside a well-formed payload are corrupted, so NIXL's
  ``loadRemoteMD`` rejects them) or ``layout`` (a well-formed agent whose KV blocks are
  half D's size, as a P with another head layout would send). ``{"fault": "none"}``
  disarms; both reply with ``served`` (bad answers given since the last arm);
* ``{"cmd": "expire", "req_ids"}``: end P's send lease of these requests now (what
  ``kv_lease_duration`` would do later), so blocks D will never release are freed; replies
  ``pending`` (leases still held: P was never told) and ``notified`` (P was told);
* ``{"cmd": "stats"}``: counters, ``finished_sending`` seen, free blocks;
* ``{"cmd": "quit"}``: close and ``os._exit(0)``.

TP. As in vLLM's engine core, P's scheduler process serves the side channel for every
rank: each rank's ``get_handshake_metadata()`` is fetched from the rank (``Worker.call``)
and keyed ``(pp_rank 0, tp_rank)``; D's rank ``r`` asks for P's rank ``r``. Notifications
are recorded and leases ended on the ranks, where upstream's worker lives.

Between commands P keeps stepping its engine (forced, so the connector's worker side runs
even when the scheduler is idle): that is what receives D's completion notification and
reports ``finished_sending``.

Injection is at P's own objects, never a scripted fake P: the side-channel listener is
upstream's thread, handed a mapping whose answer can be swapped (:class:`_ServedMetadata`),
and the notifications P receives are upstream's, only recorded on their way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvfail.peers.producer_engine import ProducerEngine, pattern_forward, producer_spec
from kvfail.peers.protocol import Handler, serve
from kvfail.rig import nixl_progress

if TYPE_CHECKING:
    from kvfail.harness.hooks import RankView

__all__ = [
    "BAD_METADATA",
    "PREFIX",
    "bad_payload",
    "main",
    "restore_affinity",
]

#: Every protocol line starts with this, so a reader can ignore anything else.
PREFIX = "@@kvfail-nixl-p "
#: P's idle loop: a forced step this often keeps notifications and lease expiry flowing.
_IDLE_STEP_S = 0.02
#: What the side channel can answer a handshake with instead of P's real metadata.
BAD_METADATA = ("garbled", "layout")


def restore_affinity(mask: set[int]) -> None:
    """Give every thread of this process the CPU mask it had before an engine was built.

    Why: on ``device_type == "cpu"`` vLLM's worker pins the calling thread to the last
    core of each NUMA node, and threads started later (nixl/UCX, the handshake executor)
    inherit that. Every vLLM CPU process on the machine then fights for one core, and
    a handshake thread starved past zmq's 5 s ``RCVTIMEO`` turns a good pull into a
    failure. The harness is not a real model worker; the transport needs no pinning.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except OSError:  # the thread ended meanwhile
            continue


def bad_payload(good: Any, kind: str) -> bytes:
    """P's real handshake payload ``good`` (a ``NixlHandshakePayload``), encoded as the
    side channel sends it, but unusable for D in the way ``kind`` names (:data:`BAD_METADATA`).

    The compatibility hash is P's real one, so D gets past that check and fails where a
    real P would make it fail: NIXL cannot load a corrupted agent (``garbled``; #50765's
    ``loadRemoteMD`` error), or D's layout check refuses blocks of another size (``layout``).
    """
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    meta = msgspec.msgpack.decode(good.agent_metadata_bytes, type=NixlAgentMetadata)
    if kind == "garbled":
        meta.agent_metadata = bytes(b ^ 0x5A for b in meta.agent_metadata)
    elif kind == "layout":
        meta.block_lens = [n // 2 for n in meta.block_lens]
        meta.block_strides = [n // 2 for n in meta.block_strides]
    else:
        raise ValueError(f"unknown bad metadata {kind!r}: one of {BAD_METADATA}")
    payload = NixlHandshakePayload(
        compatibility_hash=good.compatibility_hash,
        agent_metadata_bytes=msgspec.msgpack.encode(meta),
    )
    return bytes(msgspec.msgpack.encode(payload))


class _ServedMetadata(dict):  # type: ignore[type-arg]
    """What upstream's side-channel listener serves, keyed ``(pp_rank, tp_rank)``.

    The listener looks its answer up here for every handshake; while :attr:`bad` is set
    it gets the bad bytes of the asked rank instead of P's real ones. Set and cleared
    from P's main thread, read by the listener thread (a single attribute: atomic under
    the GIL).
    """

    bad: dict[Any, bytes] | None = None
    served = 0

    def __getitem__(self, key: Any) -> Any:
        bad = self.bad
        if bad is None:
            return super().__getitem__(key)
        self.served += 1
        return bad.get(key) or next(iter(bad.values()))


# ---------------------------------------------------------------- on each P rank
# Module-level: ``Worker.call`` pickles them by reference into a rank process.


def _handshake_payload(view: RankView) -> Any:
    """This rank's ``NixlHandshakePayload`` (what vLLM's worker hands the engine core)."""
    return view.connector.get_handshake_metadata()


def _unpin(view: RankView, mask: set[int]) -> None:
    """Undo the NIXL CPU worker's pinning on this rank (see :func:`restore_affinity`)."""
    restore_affinity(mask)


def _record_notifications(view: RankView) -> None:
    """Remember which requests D told this rank it is done with (upstream's own poll)."""
    worker: Any = view.connector.connector_worker  # type: ignore[attr-defined]
    if hasattr(worker, "kvfail_notified"):
        return
    worker.kvfail_notified = set()
    poll = worker._get_new_notifs

    def polled() -> set[str]:
        got: set[str] = poll()
        worker.kvfail_notified.update(got)
        return got

    worker._get_new_notifs = polled


def _notified(view: RankView) -> list[str]:
    worker: Any = view.connector.connector_worker  # type: ignore[attr-defined]
    return sorted(getattr(worker, "kvfail_notified", ()))


def _expire(view: RankView, req_ids: list[str]) -> tuple[list[str], list[str]]:
    """End these send leases on this rank now; upstream's next poll frees their blocks.
    Returns (leases still held, requests this rank was notified of)."""
    worker: Any = view.connector.connector_worker  # type: ignore[attr-defined]
    leases = worker._reqs_to_send
    notified = getattr(worker, "kvfail_notified", set())
    pending, told = [], []
    for req_id in req_ids:
        if req_id in leases:
            leases[req_id] = 0.0  # perf_counter domain: long past
            pending.append(req_id)
        if req_id in notified:
            told.append(req_id)
    return pending, told


class _Producer(ProducerEngine):
    def __init__(self, config: dict[str, Any]) -> None:
        from kvfail.harness import Engine

        self.engine_id = config.get("engine_id") or f"P-nixl-{os.getpid()}"
        self.port = int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        self.seeds: dict[str, str] = {}
        spec = producer_spec(
            config,
            connector="NixlConnector",
            engine_id=self.engine_id,
            extra_config=dict(config.get("extra_config") or {}),
        )
        mask = os.sched_getaffinity(0)
        self.engine = Engine(spec, forward=pattern_forward(self.seeds))
        restore_affinity(mask)
        for worker in self.engine.workers:
            if worker.remote:
                worker.call(_unpin, mask)
        sched_conn = self.engine.scheduler.connector
        assert sched_conn is not None
        # What EngineCore does after KV registration: gather every rank's metadata, keyed
        # (pp_rank, tp_rank), and start the zmq side-channel listener with it.
        self.handshake_payloads: dict[tuple[int, int], Any] = {
            (0, w.rank): w.call(_handshake_payload) for w in self.engine.workers
        }
        self.served = _ServedMetadata()
        self._serve_through(sched_conn.connector_scheduler)
        sched_conn.set_xfer_handshake_metadata_pp_aware(dict(self.handshake_payloads))
        for worker in self.engine.workers:
            worker.call(_record_notifications)
        self._init_counters()
        self._last_step = 0.0

    def _serve_through(self, scheduler: Any) -> None:
        """Have upstream's listener thread read its answers from :attr:`served`."""
        listener = scheduler._nixl_handshake_listener
        served = self.served

        def listen(encoded: dict[Any, bytes], *args: Any) -> None:
            served.update(encoded)
            listener(served, *args)

        scheduler._nixl_handshake_listener = listen

    def step(self) -> None:
        if self.engine.crashed is not None:
            return
        self._step(force=True)
        self._last_step = time.monotonic()

    def idle(self) -> None:
        """Step when busy; otherwise a forced step every ``_IDLE_STEP_S``."""
        if not self.engine.is_idle() or time.monotonic() - self._last_step >= _IDLE_STEP_S:
            self.step()
        else:
            time.sleep(0.005)

    def _start_prefill(self, req: Mapping[str, Any]) -> None:
        req_id = str(req["req_id"])
        self.seeds[req_id] = str(req.get("prompt_seed") or req_id)
        self.engine.add_request(
            req_id,
            prompt_len=int(req.get("prompt_len", 100)),
            prompt_seed=self.seeds[req_id],
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )

    def _prefilled(self, req_id: str) -> dict[str, Any] | None:
        """The params upstream's ``request_finished`` produced for D, once it did."""
        outs = [o for o in self.engine.record.outputs_for(req_id) if o.kv_transfer_params]
        return dict(outs[-1].kv_transfer_params) if outs else None

    def _prefill_step(self) -> None:
        self.step()

    def inject(self, cmd: dict[str, Any]) -> dict[str, Any]:
        fault = cmd.get("fault")
        served = self.served.served
        if fault == "none":
            self.served.bad = None
        elif fault == "bad_metadata":
            kind = str(cmd.get("kind"))
            bad = {key: bad_payload(good, kind) for key, good in self.handshake_payloads.items()}
            self.served.served = 0
            self.served.bad = bad
        else:
            return {"ok": False, "error": f"unknown fault {fault!r}: bad_metadata | none"}
        return {"ok": True, "served": served}

    def expire(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """End these send leases now, on every rank; upstream's next poll frees their
        blocks. ``pending``/``notified``: on any rank."""
        req_ids = [str(r) for r in cmd.get("req_ids") or ()]
        pending: set[str] = set()
        notified: set[str] = set()
        for worker in self._live_workers():
            held, told = worker.call(_expire, req_ids)
            pending.update(held)
            notified.update(told)
        return {
            "ok": True,
            "pending": [r for r in req_ids if r in pending],
            "notified": [r for r in req_ids if r in notified],
        }

    def notified(self) -> list[str]:
        """Requests any rank was told D is done with (empty for a crashed engine)."""
        return sorted({r for w in self._live_workers() for r in w.call(_notified)})

    def _live_workers(self) -> list[Any]:
        """The ranks that can still answer (a one-rank fault may have killed one)."""
        if self.engine.crashed is not None:
            return []
        return [w for w in self.engine.workers if w.process is None or w.process.alive()]

    def stats(self) -> dict[str, Any]:
        return self._stats(notified=self.notified(), bad_metadata_served=self.served.served)

    def _own_commands(self) -> dict[str, Handler]:
        return {"expire": self.expire}


def main(argv: list[str] | None = None) -> None:
    """Entry point; never returns (``os._exit``: the nixl teardown segfault)."""
    serve(
        argv,
        doc=__doc__,
        prefix=PREFIX,
        build=lambda config, _channel: _Producer(config),
        ready=lambda p: {
            "engine_id": p.engine_id,
            "side_channel_port": p.port,
            "rank_pids": [w.process.pid if w.process else os.getpid() for w in p.engine.workers],
            # The progress-thread delay this process's agents got (None: NIXL's busy poll).
            "nixl_pthr_delay_us": nixl_progress.current_delay_us(),
        },
        idle=lambda p: p.idle(),
    )


if __name__ == "__main__":
    main()
