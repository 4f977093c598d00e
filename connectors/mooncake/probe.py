"""Is a P worker unreachable, and are its writes over? A watch of its side channel and
its writer mark, for Mooncake's D worker.

Why the side-channel port: it is the socket D's pull talks to; when it refuses, D's pulls
to that worker cannot be answered any more, so they are failed at once. That alone does
not prove P stopped writing (a graceful shutdown closes the side channel before the
sender threads stop), so the blocks are given back only on the worker's writer mark
(:mod:`connectors.writer_mark`). ZMQ hides a dead peer (the DEALER reconnects and queues
forever), and D cannot use the TransferEngine's ``send_probe``: Mooncake is P-push, so D
never learns P's transfer-engine session.

The watch runs on D's receiver loop (asyncio), one task per P worker address, only
while that address has pulls in flight or a pull that ended without P's answer. The
rule for what counts as a refusal is the one every kvfail probe follows
(:mod:`connectors.side_channel`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from connectors.side_channel import PROBE_REFUSALS, close_rst, resolved_socket
from connectors.writer_mark import ask_writer_mark

__all__ = [
    "DEFAULT_PROBE_INTERVAL_S",
    "PROBE_CONFIRM_S",
    "PROBE_CONNECT_TIMEOUT_S",
    "MarkBook",
    "connect_probe",
    "refused_before_send",
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
    lost: Callable[[str], None],
    gone: Callable[[str], None],
    marks: MarkBook,
) -> None:
    """Watch the P worker at ``worker_addr`` while ``watched()``.

    Two verdicts, because a closed side channel is not a stopped writer:

    * ``lost(reason)``: the side channel refuses connects (:data:`PROBE_REFUSALS` in a
      row). What the pulls to this worker still owe is failed now, but the blocks stay
      held: a P shutting down gracefully closes its side channel first while a push may
      still land. Called again only after the side channel answered in between.
    * ``gone(reason)``, then return: the worker's writer mark
      (:mod:`connectors.writer_mark`), seen before, refuses, or a new one answers at the
      address. Only this ends the holds.

    ``marks`` keeps each address's nonce across watches (the caller owns it), so a watch
    started after the worker died still knows it had a mark. :func:`refused_before_send`
    refreshes it before a pull leaves D while no watch runs, so a worker that dies before
    this watch first asks is still proven gone, and one restarted unseen meanwhile is
    not taken for the pull's writer's end.

    Event-driven: the probe holds a TCP connection to the side channel, so P's death or
    shutdown reaches D as it happens (EOF or reset); the mark is asked then, and at every
    refused connect. An end of the connection alone is only a question (P's ZMQ also
    drops a peer that never greets it). Without a held connection it connects every
    ``interval_s``.

    Why no false verdicts: only ``ECONNREFUSED`` counts, and the kernel refuses only
    when nothing listens (TCP) or nothing is bound (UDP). A P that is slow, busy or
    SIGSTOPped keeps both sockets: its connects complete, its mark is silent (unknown,
    which proves nothing). Silence is left to the deadline. Connections close with RST
    (no TIME_WAIT pile-up); one task per P worker address, on the receiver loop, only
    while that address has pulls in flight or holds: bounded cost.
    """
    held: socket.socket | None = None
    try:
        endpoint = tcp_endpoint(worker_addr)
        if endpoint is None:
            return  # not a TCP address we can probe (ipc://, malformed): deadline only
        mark = _MarkWatch(worker_addr, *endpoint, marks)
        refusals, reported = 0, False
        while watched():
            # Every round, side channel open or not: a P whose teardown wedged keeps its
            # side channel open, and only its mark says its writes are over.
            reason = await mark.check()
            if reason is not None:
                gone(reason)
                return
            if held is not None:
                if await _closed_by_peer(held, interval_s):
                    close_rst(held)
                    held = None  # ended: P gone, shut down, restarted, or ZMQ dropped us
                continue
            verdict, sock = await _connect(*endpoint, PROBE_CONNECT_TIMEOUT_S)
            if sock is not None:
                held, refusals, reported = sock, 0, False
                continue
            refusals = refusals + 1 if verdict == "refused" else 0
            if refusals >= PROBE_REFUSALS and not reported:
                reported = True
                lost(
                    f"P worker {worker_addr} is unreachable: its side channel refused "
                    f"{refusals} connects in a row"
                )
            confirming = 0 < refusals < PROBE_REFUSALS
            await asyncio.sleep(PROBE_CONFIRM_S if confirming else interval_s)
    finally:
        if held is not None:
            close_rst(held)


class MarkBook(dict[str, bytes]):
    """Each P worker address's writer-mark nonce, as D last saw it, and the addresses
    whose nonce may not be the writer of D's latest pull there.

    Unconfirmed: the mark did not answer before that pull left D (a stopped or busy P).
    The writer is then the nonce's holder, or a P restarted unseen since. A refusal still
    proves both gone (no mark is bound there), but a new nonce proves nothing: it may be
    the pull's own writer. Seen answering, it becomes the one watched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unconfirmed: set[str] = set()

    def saw(self, worker_addr: str, nonce: bytes) -> None:
        self[worker_addr] = nonce
        self.unconfirmed.discard(worker_addr)

    def forget(self, worker_addr: str) -> None:
        self.pop(worker_addr, None)
        self.unconfirmed.discard(worker_addr)


class _MarkWatch:
    """What one watch has learnt of an address's writer mark."""

    def __init__(self, worker_addr: str, host: str, port: int, marks: MarkBook) -> None:
        self.worker_addr, self.host, self.port = worker_addr, host, port
        self.marks = marks

    async def check(self) -> str | None:
        """Ask the mark (a refusal is confirmed at once); the reason the writer is proven
        gone, or None."""
        for refusals in range(1, PROBE_REFUSALS + 1):
            answer, nonce = await ask_writer_mark(self.host, self.port, PROBE_CONNECT_TIMEOUT_S)
            seen = self.marks.get(self.worker_addr)
            if answer == "alive" and nonce is not None:
                unsure = self.worker_addr in self.marks.unconfirmed
                self.marks.saw(self.worker_addr, nonce)
                if seen is not None and nonce != seen and not unsure:
                    return (
                        f"P worker {self.worker_addr} was restarted: a new writer answers at "
                        "its address, so the one D pulled from is gone"
                    )
                return None
            if answer != "refused" or seen is None:
                return None  # unknown, or never seen: proves nothing
            if refusals < PROBE_REFUSALS:
                await asyncio.sleep(PROBE_CONFIRM_S)
        # The dead writer's nonce stays in the book: a pull whose pre-send check saw it,
        # and that registers only after this proof (its check was still waiting), gets a
        # watch of its own, and only the nonce lets that watch prove the same death. A P
        # restarted at the address replaces it at the next pull's pre-send check.
        return (
            f"P worker {self.worker_addr}'s writes are over: its writer mark refused "
            f"{PROBE_REFUSALS} times in a row"
        )


#: Bound on the connect before a pull is sent: short, since the pull waits for it, and a
#: connect that does not complete in time proves nothing (the pull goes ahead).
PREFLIGHT_TIMEOUT_S: Final = 0.2


async def refused_before_send(worker_addr: str, marks: MarkBook) -> str | None:
    """Why the P worker at ``worker_addr`` cannot receive a pull now, or None.

    Asked before D's pull leaves D: a side channel that refuses :data:`PROBE_REFUSALS`
    connects in a row has nothing listening, so the pull would never reach the process
    that had the request, and nothing of it can be written. Proof for any P, with a
    writer mark or without, which the watch, started once the pull is out, cannot give
    for a worker whose mark it never saw.

    A worker that accepts is asked for its writer mark too: seen before the pull is
    sent, its nonce belongs to the writer the pull reaches, so that writer's death is
    proof for the watch even if it dies before the watch first asks, and a P restarted
    since D last looked is recorded as the new writer, not read later as proof that the
    pull's writer is gone. A mark that refuses (an upstream P) leaves nothing recorded;
    one that does not answer within :data:`PREFLIGHT_TIMEOUT_S` (a stopped or busy P)
    leaves the nonce D had, unconfirmed (:class:`MarkBook`). The pull goes ahead.
    """
    endpoint = tcp_endpoint(worker_addr)
    if endpoint is None:
        return None
    for refusals in range(1, PROBE_REFUSALS + 1):
        if await connect_probe(*endpoint, PREFLIGHT_TIMEOUT_S) != "refused":
            answer, nonce = await ask_writer_mark(*endpoint, PREFLIGHT_TIMEOUT_S)
            if answer == "alive" and nonce is not None:
                marks.saw(worker_addr, nonce)
            elif answer == "refused":
                # No mark: a P without one (upstream's), or one that died after the
                # connect. Only the side channel tells them apart; a dead one's refusal
                # counts, so the pull is not sent to a P no watch could prove gone.
                if await connect_probe(*endpoint, PREFLIGHT_TIMEOUT_S) == "refused":
                    continue
                marks.forget(worker_addr)
            elif worker_addr in marks:
                marks.unconfirmed.add(worker_addr)
            return None
        if refusals < PROBE_REFUSALS:
            await asyncio.sleep(PROBE_CONFIRM_S)
    return (
        f"P worker {worker_addr} refused {PROBE_REFUSALS} connects before the pull was "
        "sent: nothing reached it"
    )


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
    resolved = await resolved_socket(host, port, socket.SOCK_STREAM, timeout_s)
    if resolved is None:
        return "unknown", None
    sock, address = resolved
    loop = asyncio.get_running_loop()
    try:
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
