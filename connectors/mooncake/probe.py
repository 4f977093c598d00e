"""Is a P worker gone? A TCP watch of its side channel, for Mooncake's D worker.

Why the side-channel port: it is the socket D's pull talks to, and its listener lives
exactly as long as P's worker. ZMQ hides a dead peer (the DEALER reconnects and queues
forever), and D cannot use the TransferEngine's ``send_probe``: Mooncake is P-push, so D
never learns P's transfer-engine session.

The watch runs on D's receiver loop (asyncio), one task per P worker address, only
while that address has pulls in flight or a pull that ended without P's answer. The
rule for what counts as gone is the one every kvfail probe follows
(:mod:`connectors.side_channel`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from connectors.side_channel import PROBE_REFUSALS, close_rst

__all__ = [
    "DEFAULT_PROBE_INTERVAL_S",
    "PROBE_CONFIRM_S",
    "PROBE_CONNECT_TIMEOUT_S",
    "connect_probe",
    "tcp_endpoint",
    "watch_side_channel",
]

#: Default for ``kv_connector_extra_config["kvfail_probe_interval_s"]``: how often each P
#: worker that D is pulling from is probed for liveness when no connection to it can be
#: held (a held one reports P's death as it happens); None/0 disables the probe.
DEFAULT_PROBE_INTERVAL_S: Final = 0.2
#: Pause before a refusal is confirmed: short, since a refusal is already an answer.
PROBE_CONFIRM_S: Final = 0.01
#: Bound on one probe's TCP connect. A connect that neither completes nor is refused in
#: this time (SYN dropped: a full accept queue, e.g. of a stopped P) proves nothing.
PROBE_CONNECT_TIMEOUT_S: Final = 1.0


async def watch_side_channel(
    worker_addr: str,
    interval_s: float,
    *,
    watched: Callable[[], bool],
    gone: Callable[[str], None],
) -> None:
    """Watch ``worker_addr`` while ``watched()``; call ``gone(reason)`` once if P's
    worker is gone, and return.

    Event-driven: the probe holds a TCP connection to that port, so P's death reaches
    D as it happens (its kernel closes the connection: EOF or reset). An end of the
    connection is only a question (P's ZMQ also drops a peer that never greets it);
    connects answer it. Without a held connection (a connect that does not complete)
    it connects every ``interval_s``.

    Why no false positives: only ``ECONNREFUSED`` counts, :data:`PROBE_REFUSALS`
    times in a row, and the kernel refuses a connect only when nothing listens on the
    port, i.e. P's process (or its socket) is gone. A P that is slow, busy or even
    SIGSTOPped keeps its listening socket and the held connection, so the kernel
    completes a connect (or, with a full accept queue, drops the SYN: a timeout,
    which counts as nothing). Silence is left to the deadline. Connections close
    with RST (no TIME_WAIT pile-up); one task per P worker address, on the receiver
    loop, only while that address has pulls in flight or a pull that ended without
    P's answer may still be written by it: bounded cost.
    """
    held: socket.socket | None = None
    try:
        endpoint = tcp_endpoint(worker_addr)
        if endpoint is None:
            return  # not a TCP address we can probe (ipc://, malformed): deadline only
        refusals = 0
        while watched():
            if held is not None:
                if not await _closed_by_peer(held, interval_s):
                    continue  # still open: P's process holds it
                close_rst(held)
                held = None  # ended: a connect tells a dead P from a dropped peer
            verdict, sock = await _connect(*endpoint, PROBE_CONNECT_TIMEOUT_S)
            if sock is not None:
                held, refusals = sock, 0
                continue
            refusals = refusals + 1 if verdict == "refused" else 0
            if refusals >= PROBE_REFUSALS:
                gone(
                    f"P worker {worker_addr} is gone: its side channel refused "
                    f"{refusals} connects in a row"
                )
                return
            await asyncio.sleep(PROBE_CONFIRM_S if refusals else interval_s)
    finally:
        if held is not None:
            close_rst(held)


def tcp_endpoint(worker_addr: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://host:port`` ZMQ address, else None."""
    try:
        parts = urlsplit(worker_addr)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        return None
    return parts.hostname, port


async def _connect(host: str, port: int, timeout_s: float) -> tuple[str, socket.socket | None]:
    """One TCP connect: ``("alive", the connected socket)``, ``("refused", None)`` (nothing
    listens) or ``("unknown", None)``."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s
        )
    except (OSError, TimeoutError):
        return "unknown", None
    if not infos:
        return "unknown", None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, address), timeout_s)
    except ConnectionRefusedError:
        close_rst(sock)
        return "refused", None
    except BaseException as exc:
        close_rst(sock)
        if isinstance(exc, (OSError, TimeoutError)):
            return "unknown", None
        raise
    return "alive", sock


async def connect_probe(host: str, port: int, timeout_s: float) -> str:
    """One TCP connect, closed at once: ``"alive"``, ``"refused"`` or ``"unknown"``."""
    verdict, sock = await _connect(host, port, timeout_s)
    if sock is not None:
        close_rst(sock)
    return verdict


async def _closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end closed ``sock`` (EOF or reset) within ``wait_s``; bytes it
    sends (a ZMQ greeting) are read and ignored."""
    loop = asyncio.get_running_loop()
    try:
        data = await asyncio.wait_for(loop.sock_recv(sock, 256), wait_s)
    except TimeoutError:
        return False
    except OSError:
        return True
    return not data
