"""A scripted Mooncake prefiller (P) for D-side tests: real side channel, no data.

Why: D's failure paths are all decided by what P answers on the ZMQ side channel (or
does not answer). This fake speaks upstream's wire format (``MooncakeXferMetadata`` in,
``MooncakeXferResponse`` out, msgpack) from ROUTER sockets bound to 127.0.0.1 and
registered on upstream's own ``MooncakeBootstrapServer``, so D runs its real bootstrap
query, its real DEALER exchange and its real reply handling. It never writes KV data.

Each request's behaviour is chosen by the prefix of its ``transfer_id`` (``"<mode>-..."``):

=========  =====================================================================
ok         reported in ``ok_reqs``
err        reported in ``err_reqs``
omit       not mentioned in the FINISH reply
error      the whole exchange gets an ``ERROR`` reply (as on a TP/layout mismatch)
garbage    the whole exchange gets bytes that are not a valid reply
silent     no reply to the exchange, ever
late       ``ok`` after :data:`LATE_S` (a silent peer that wakes up)
unknown    ``ok``, and P also names a request D never asked for
split      on a two-worker engine: rank 0 ``ok`` now, rank 1 ``ok`` after SPLIT_S
spliterr   on a two-worker engine: rank 0 ``ok`` now, rank 1 ``err`` after SPLIT_S
=========  =====================================================================

One thread owns every socket (ZMQ sockets are not thread-safe); every wait is bounded and
:meth:`FakePrefill.close` stops the thread, the sockets and the bootstrap server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferMetadata,
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
    RegisterWorkerPayload,
)

LATE_S = 3.0
SPLIT_S = 0.4
ONE = "P-one"  # one P worker
TWO = "P-two"  # two P workers (TP 2), so D pulls from both
#: Registered with an address ZMQ refuses to connect to: D's side channel raises.
BOGUS = "P-bogus"
#: Registered with TP rank 1 only: D looks for rank 0 and upstream's receive_kv raises.
HOLEY = "P-holey"


@dataclass
class Exchange:
    """One request message a fake P worker received, and when it answered."""

    worker: str
    req_ids: tuple[str, ...]
    received_at: float
    replied_at: list[float] = field(default_factory=list)


@dataclass
class _Worker:
    name: str
    rank: int
    sock: zmq.Socket  # type: ignore[type-arg]
    addr: str


class FakePrefill:
    """Two fake P engines on one bootstrap server: ``P-one`` (1 worker), ``P-two`` (2)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._workers: list[_Worker] = []
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._meta = msgspec.msgpack.Decoder(MooncakeXferMetadata)
        self._enc = msgspec.msgpack.Encoder()
        self._due: list[tuple[float, _Worker, bytes, bytes, Exchange]] = []
        self.bootstrap = MooncakeBootstrapServer("127.0.0.1", 0)
        try:
            self.bootstrap.start(timeout=10.0)
            for dp_rank, (engine, tp_size) in enumerate(((ONE, 1), (TWO, 2))):
                for rank in range(tp_size):
                    self._add_worker(engine, dp_rank, rank)
            self._register(BOGUS, 2, 0, "tcp://127.0.0.1:notaport")
            self._register(HOLEY, 3, 1, self._workers[0].addr)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="fake-mooncake-p", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap.port}"

    def _add_worker(self, engine: str, dp_rank: int, rank: int) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        name = f"{engine}/{rank}"
        self._workers.append(_Worker(name, rank, sock, addr))
        self._register(engine, dp_rank, rank, addr)

    def _register(self, engine: str, dp_rank: int, rank: int, addr: str) -> None:
        payload = RegisterWorkerPayload(
            engine_id=engine, dp_rank=dp_rank, tp_rank=rank, pp_rank=0, addr=addr
        )
        # The server's handler is a plain coroutine; no HTTP round trip needed here.
        asyncio.run(self.bootstrap.register_worker(payload))

    def worker_addr(self, name: str) -> str:
        """Side-channel address of a fake P worker, e.g. ``"P-one/0"``."""
        return next(w.addr for w in self._workers if w.name == name)

    def exchanges_for(self, req_id: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if req_id in e.req_ids]

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        for worker in self._workers:
            poller.register(worker.sock, zmq.POLLIN)
        by_sock = {w.sock: w for w in self._workers}
        while not self._stop.is_set():
            for sock, _ in poller.poll(timeout=20):
                worker = by_sock[sock]
                identity, payload = sock.recv_multipart()
                self._answer(worker, identity, payload)
            now = time.monotonic()
            ready = [d for d in self._due if d[0] <= now]
            self._due = [d for d in self._due if d[0] > now]
            for _, worker, identity, reply, exchange in ready:
                # Stamped before the send: D may see the reply, and finish the load,
                # before a stamp taken after the send, so only this one bounds it.
                with self._lock:
                    exchange.replied_at.append(time.monotonic())
                worker.sock.send_multipart([identity, reply])

    def _answer(self, worker: _Worker, identity: bytes, payload: bytes) -> None:
        meta = self._meta.decode(payload)
        modes = {
            req: transfer_id.split("-", 1)[0] for req, (transfer_id, _) in meta.req_blocks.items()
        }
        exchange = Exchange(worker.name, tuple(modes), time.monotonic())
        with self._lock:
            self.exchanges.append(exchange)
        for delay, reply in self._script(worker, modes):
            self._due.append((exchange.received_at + delay, worker, identity, reply, exchange))

    def _script(self, worker: _Worker, modes: dict[str, str]) -> Iterable[tuple[float, bytes]]:
        kinds = set(modes.values())
        if "silent" in kinds:
            return []
        if "error" in kinds:
            return [
                (0.0, self._reply(MooncakeXferResponseStatus.ERROR, err_msg="fake P: mismatch"))
            ]
        if "garbage" in kinds:
            return [(0.0, b"\xc1 not a reply")]
        ok: list[str] = []
        err: list[str] = []
        delay = 0.0
        for req, mode in modes.items():
            late_rank = worker.rank == 1 and mode in ("split", "spliterr")
            if mode == "late":
                delay = max(delay, LATE_S)
            if late_rank:
                delay = max(delay, SPLIT_S)
            if mode == "err" or (late_rank and mode == "spliterr"):
                err.append(req)
            elif mode in ("ok", "late", "unknown", "split", "spliterr"):
                ok.append(req)
            if mode == "unknown":
                ok.append(f"ghost-ok-{req}")
                err.append(f"ghost-err-{req}")
        reply = self._reply(
            MooncakeXferResponseStatus.FINISH,
            ok_reqs=ok or None,
            err_reqs=err or None,
            err_msg="fake P: failed" if err else None,
        )
        return [(delay, reply)]

    def _reply(self, status: MooncakeXferResponseStatus, **fields: object) -> bytes:
        return self._enc.encode(MooncakeXferResponse(status=status, **fields))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout=5.0)
        for worker in self._workers:
            worker.sock.close(linger=0)
        self._ctx.term()
        self.bootstrap.shutdown()


class SlowBootstrap:
    """An HTTP bootstrap server on 127.0.0.1 that answers ``GET /query`` after ``delay_s``.

    Until then D's query hangs, as it does on a stopped P (upstream retries three times
    with a 30 s timeout each). The answer maps ``engine_id`` to ``worker_addr``.
    """

    def __init__(self, engine_id: str, worker_addr: str, delay_s: float) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = int(self._listener.getsockname()[1])
        body = {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": worker_addr}}}}
        self._body = json.dumps(body).encode()
        self._delay_s = delay_s
        self._stop = threading.Event()
        self.answered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-bootstrap", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        conns: list[tuple[float, socket.socket]] = []
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
                conns.append((time.monotonic() + self._delay_s, conn))
            except TimeoutError:
                pass
            now = time.monotonic()
            for due, conn in [c for c in conns if c[0] <= now]:
                conns.remove((due, conn))
                with conn:
                    conn.settimeout(1.0)
                    try:
                        conn.recv(65536)
                        head = (
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(self._body)}\r\nConnection: close\r\n\r\n"
                        )
                        conn.sendall(head.encode() + self._body)
                        self.answered.set()
                    except OSError:
                        pass
        for _, conn in conns:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._listener.close()
