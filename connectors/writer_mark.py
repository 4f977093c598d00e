"""A P worker's writer mark: the one sign D may take as proof that the worker's writes
into D's blocks are over.

Why not P's side channel: a listener that refuses connections proves only that the
listener is closed. vLLM's graceful shutdown of a Mooncake P closes its ZMQ context (the
side channel) first and stops its sender threads without waiting, so a write already
under way lands after D sees the refusals. D must then keep the blocks held: the failure
can be reported at once, the blocks given back only later.

What the mark is: a UDP socket P's worker binds on its side channel's port number (UDP
and TCP ports are separate spaces, so D finds it without being told where) and answers
with a nonce chosen when the worker started. It closes only when the worker's writes are
over: after shutdown, once its sender threads have finished, or when the process dies
(the kernel closes it). So D, which has seen the nonce, may take

* the mark refusing (ICMP port unreachable, :data:`connectors.side_channel.PROBE_REFUSALS`
  times in a row) as proof that the writer is gone, and
* a different nonce at the same address as proof that the writer which held it is gone
  (P restarted on the same address: the old socket had to close for the new one to bind).

Anything else proves nothing: a P that never answered (an upstream P, which has no mark;
a port some other process took; a network that drops ICMP) leaves the blocks held, which
is the safe side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from typing import Final, Literal

from connectors.side_channel import resolved_socket

__all__ = ["MARK_REPLY", "MARK_REQUEST", "WriterMark", "ask_writer_mark", "start_writer_mark"]

logger = logging.getLogger(__name__)

#: What D sends; anything else is ignored (a stray datagram gets no answer).
MARK_REQUEST: Final = b"kvfail-writer-mark?"
#: What P answers, followed by its nonce.
MARK_REPLY: Final = b"kvfail-writer-mark/1 "
_NONCE_BYTES: Final = 16
#: Bound on waiting for the answering thread to leave its receive at close.
_WAKE_TIMEOUT_S: Final = 1.0

Answer = Literal["alive", "refused", "unknown"]


class WriterMark:
    """The mark of one P worker: a bound UDP socket and a daemon thread answering it.

    A daemon thread, so that the mark never keeps a process alive; the socket is closed
    by :meth:`close` (after the worker's writes ended) or by the kernel at exit.
    """

    def __init__(self, host: str, port: int) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        self._sock = socket.socket(family, kind, proto)
        try:
            self._sock.bind(address)
        except OSError:
            self._sock.close()
            raise
        self.nonce = os.urandom(_NONCE_BYTES)
        self.address = f"{host}:{port}"
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._answer, name=f"kvfail-writer-mark-{port}", daemon=True
        )
        self._thread.start()

    def _answer(self) -> None:
        reply = MARK_REPLY + self.nonce
        while not self._closed.is_set():
            try:
                data, peer = self._sock.recvfrom(256)
            except OSError:
                return  # closed
            if self._closed.is_set():
                return
            if data == MARK_REQUEST:
                with contextlib.suppress(OSError):
                    self._sock.sendto(reply, peer)

    def close(self) -> None:
        """Stop answering: only once nothing of this worker can write any more."""
        if self._closed.is_set():
            return
        self._closed.set()
        # Wake the thread out of recvfrom first: a socket closed while a thread waits in
        # it stays bound until a datagram arrives, answering nothing and refusing nothing.
        with (
            contextlib.suppress(OSError),
            socket.socket(self._sock.family, socket.SOCK_DGRAM) as waker,
        ):
            waker.sendto(b"", self._sock.getsockname())
        self._thread.join(timeout=_WAKE_TIMEOUT_S)
        self._sock.close()


def start_writer_mark(host: str, port: int) -> WriterMark | None:
    """The mark on ``host``'s UDP ``port``, or None when it cannot be bound (D then has no
    proof from this worker, and holds its blocks: the safe side)."""
    try:
        return WriterMark(host, port)
    except OSError as exc:
        logger.warning(
            "kvfail: no writer mark on %s:%s (%s): D cannot prove this worker's writes over, "
            "and keeps the blocks of its failed loads held",
            host,
            port,
            exc,
        )
        return None


async def ask_writer_mark(host: str, port: int, timeout_s: float) -> tuple[Answer, bytes | None]:
    """Ask the mark at ``host:port``: ``("alive", nonce)``, ``("refused", None)`` (nothing
    bound there: the kernel answered with port unreachable) or ``("unknown", None)`` (no
    answer in time, a name that does not resolve, a reply that is not a mark's).

    Non-blocking on the calling loop: the lookup is the loop's own (a thread), the rest
    is a non-blocking socket.
    """
    resolved = await resolved_socket(host, port, socket.SOCK_DGRAM, timeout_s)
    if resolved is None:
        return "unknown", None
    sock, address = resolved
    loop = asyncio.get_running_loop()
    try:
        sock.connect(address)  # UDP: no packet; makes the kernel report port unreachable
        await loop.sock_sendall(sock, MARK_REQUEST)
        data = await asyncio.wait_for(loop.sock_recv(sock, 256), timeout_s)
    except ConnectionRefusedError:
        return "refused", None
    except (OSError, TimeoutError):
        return "unknown", None
    finally:
        sock.close()
    if not data.startswith(MARK_REPLY) or len(data) != len(MARK_REPLY) + _NONCE_BYTES:
        return "unknown", None
    return "alive", data[len(MARK_REPLY) :]
