"""A small P/D proxy of our own, on aiohttp: prefill on P, then decode on D.

Why our own: the test needs to control the gap between the prefill and the decode (the
moment when the KV sits on P and D has not pulled it yet), to inject a fault exactly there.
`Gate` holds decodes after their prefill has finished; the test kills or freezes P, then opens
the gate, and D has to load KV from a P that is gone or silent.

Flow per request (``/v1/completions``):
1. to P: the same body with ``max_tokens=1`` and ``kv_transfer_params`` asking P to keep the
   KV for a remote decode (NIXL: ``{"do_remote_decode": true}``; Mooncake also needs a
   ``transfer_id`` chosen by the router);
2. to D: the original body with the ``kv_transfer_params`` P returned (NIXL), or, for
   Mooncake, whose P returns none, the params D needs to find P (engine id, bootstrap
   address, the same ``transfer_id``).
Errors: P unreachable or failing -> 502 with the reason; D's status and body pass through.
A streamed request (``"stream": true``) is prefilled on P without streaming; D's event stream
is relayed piece by piece.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web

from kvfail.rig.ports import free_port

HOST = "127.0.0.1"


@dataclass
class Backend:
    """Where P and D are; swapped when P is restarted."""

    prefill_url: str
    decode_url: str
    connector: Literal["nixl", "mooncake"] = "nixl"
    #: Mooncake only: P's pinned engine id and bootstrap address (``http://host:port``).
    p_engine_id: str | None = None
    p_bootstrap_addr: str | None = None


@dataclass
class ProxyStats:
    prefills_done: int = 0
    prefill_errors: int = 0
    decodes_sent: int = 0
    held: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)


class PDProxy:
    """The proxy, running its own event loop in a daemon thread, bound to 127.0.0.1."""

    def __init__(
        self, backend: Backend, *, prefill_timeout_s: float = 60.0, decode_timeout_s: float = 120.0
    ) -> None:
        self.backend = backend
        self.port = free_port()
        self.stats = ProxyStats()
        self._prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout_s)
        self._decode_timeout = aiohttp.ClientTimeout(total=decode_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._gate_open: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="pd-proxy", daemon=True)
        self._thread.start()
        self._call(self._start(), 30.0)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    # ------------------------------------------------------------------ control (any thread)

    def _call(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def hold(self) -> None:
        """Close the gate: decodes wait after their prefill until `release`."""
        self._loop.call_soon_threadsafe(self._gate().clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._gate().set)

    def wait_held(self, n: int, timeout_s: float) -> None:
        """Block until `n` requests have finished their prefill and wait at the gate."""
        deadline = time.monotonic() + timeout_s
        while self.stats.held < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.stats.held} of {n} requests held in {timeout_s}s")
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._stop(), 15.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    # ------------------------------------------------------------------ server

    def _gate(self) -> asyncio.Event:
        assert self._gate_open is not None
        return self._gate_open

    async def _start(self) -> None:
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        # No connection reuse to P: a killed P must not leave a dead pooled socket around,
        # and a restarted P lives on another port anyway.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def _stop(self) -> None:
        self._gate().set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _note(self, what: str) -> None:
        self.stats.events.append((time.monotonic(), what))

    async def _completions(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        backend = self.backend  # one snapshot per request: P may be swapped meanwhile
        assert self._session is not None
        prefill = dict(body, max_tokens=1, stream=False)
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        if backend.connector == "nixl":
            prefill["kv_transfer_params"] = {"do_remote_decode": True}
        else:
            prefill["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        try:
            async with self._session.post(
                f"{backend.prefill_url}/v1/completions", json=prefill, timeout=self._prefill_timeout
            ) as r:
                p_body = await r.json(content_type=None)
                if r.status != 200:
                    self.stats.prefill_errors += 1
                    return web.json_response(
                        {"error": {"message": f"prefill: {p_body}"}}, status=502
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.stats.prefill_errors += 1
            return web.json_response({"error": {"message": f"prefill failed: {exc!r}"}}, status=502)
        self.stats.prefills_done += 1
        if backend.connector == "nixl":
            params = p_body.get("kv_transfer_params")
            if not params:
                return web.json_response(
                    {"error": {"message": "P returned no kv params"}}, status=502
                )
        else:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": backend.p_engine_id,
                "remote_bootstrap_addr": backend.p_bootstrap_addr,
                "transfer_id": transfer_id,
            }
        gate = self._gate()
        if not gate.is_set():
            self.stats.held += 1
            await gate.wait()
            self.stats.held -= 1
        decode = dict(body, kv_transfer_params=params)
        self.stats.decodes_sent += 1
        self._note("decode")
        try:
            async with self._session.post(
                f"{backend.decode_url}/v1/completions", json=decode, timeout=self._decode_timeout
            ) as r:
                if body.get("stream") and r.status == 200:
                    return await self._relay(request, r)
                raw = await r.read()
                return web.Response(body=raw, status=r.status, content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response({"error": {"message": f"decode failed: {exc!r}"}}, status=504)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Pass D's event stream on as each piece arrives, so a client's time to first token
        through the proxy is D's (``bench.pd_overhead`` measures it), not the whole answer's."""
        out = web.StreamResponse(
            status=upstream.status, headers={"Content-Type": "text/event-stream"}
        )
        await out.prepare(request)
        async for piece in upstream.content.iter_any():
            await out.write(piece)
        await out.write_eof()
        return out
