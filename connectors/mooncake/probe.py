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
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from connectors.side_channel import PROBE_REFUSALS, close_rst, resolved_socket
from connectors.writer_mark import ask_writer_mark

__all__ = [
    "DEFAULT_PROBE_INTERVAL_S",
    "PROBE_CONFIRM_S",
    "PROBE_CONNECT_TIMEOUT_S",
    "MarkBook",
    "MarkSeen",
    "PullWriter",
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
    writers: Callable[[], Collection[PullWriter]],
    lost: Callable[[str], None],
    gone: Callable[[str, list[PullWriter]], None],
    marks: MarkBook,
) -> None:
    """Watch the P worker at ``worker_addr`` while ``writers()`` names any pull there.

    Two verdicts, because a closed side channel is not a stopped writer:

    * ``lost(reason)``: the side channel refuses connects (:data:`PROBE_REFUSALS` in a
      row). What the pulls to this worker still owe is failed now, but the blocks stay
      held: a P shutting down gracefully closes its side channel first while a push may
      still land. Called again only after the side channel answered in between.
    * ``gone(reason, ended)``: the writers of the pulls in ``ended`` are proven gone by
      the address's writer mark (:mod:`connectors.writer_mark`): it refuses, or another
      nonce answers there than the one a pull's writer was seen with
      (:meth:`PullWriter.ended_by`). Only this ends holds, and only those pulls': a P
      restarted at the address may be the writer of pulls sent since.

    Each pull carries its own :class:`PullWriter`, taken from ``marks`` when it left D:
    a watch started after the worker died still knows it had a mark, and a pull sent
    while the watch runs (no mark asked on its path) is judged only by rounds that
    began after it left.

    Event-driven: the probe holds a TCP connection to the side channel, so P's death or
    shutdown reaches D as it happens (EOF or reset); the mark is asked every round. An
    end of the connection alone is only a question (P's ZMQ also drops a peer that never
    greets it). Without a held connection it connects every ``interval_s``.

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
        host, port = endpoint
        refusals, reported = 0, False
        while current := writers():
            # Every round, side channel open or not: a P whose teardown wedged keeps its
            # side channel open, and only its mark says its writes are over.
            seen = await _ask_mark(
                worker_addr, host, port, marks, any(w.nonce is not None for w in current)
            )
            if seen is not None:
                ended = [w for w in writers() if w.ended_by(seen)]
                if ended:
                    gone(seen.reason(worker_addr), ended)
                    continue
            if held is not None:
                if await _closed_by_peer(held, interval_s):
                    close_rst(held)
                    held = None  # ended: P gone, shut down, restarted, or ZMQ dropped us
                continue
            verdict, sock = await _connect(host, port, PROBE_CONNECT_TIMEOUT_S)
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
    """Each P worker address's writer-mark nonce, as D last saw it, and how many rounds
    of asking its mark have begun there.

    The nonce is where a new pull's :class:`PullWriter` starts from. A dead writer's
    nonce stays: a pull whose pre-send check saw it, registering only after a watch
    proved that writer gone, is proven by the same death. A P restarted at the address
    replaces it at the next answer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[str, int] = {}

    def saw(self, worker_addr: str, nonce: bytes) -> None:
        self[worker_addr] = nonce

    def forget(self, worker_addr: str) -> None:
        self.pop(worker_addr, None)

    def begin_round(self, worker_addr: str) -> int:
        """Number a new round of asking the mark at ``worker_addr``."""
        self.rounds[worker_addr] = self.rounds.get(worker_addr, 0) + 1
        return self.rounds[worker_addr]

    def writer_for(self, worker_addr: str) -> PullWriter:
        """The writer of a pull leaving D for ``worker_addr`` now, as far as D knows."""
        return PullWriter(self.get(worker_addr), self.rounds.get(worker_addr, 0))


@dataclass(frozen=True)
class MarkSeen:
    """What one round of asking an address's writer mark proved: ``nonce`` answers
    there, or (None) nothing is bound there (refused, confirmed)."""

    nonce: bytes | None
    round: int

    def reason(self, worker_addr: str) -> str:
        if self.nonce is None:
            return (
                f"P worker {worker_addr}'s writes are over: its writer mark refused "
                f"{PROBE_REFUSALS} times in a row"
            )
        return (
            f"P worker {worker_addr} was restarted: a new writer answers at its address, "
            "so the one D pulled from is gone"
        )


@dataclass(eq=False)
class PullWriter:
    """Who may still write one pull's blocks: a writer mark's nonce at the pull's address.

    ``nonce`` starts as the one D knew when the pull left (None: no mark seen there, an
    upstream P or one that never answered), and ``after`` is the address's round count
    then. Only a round that began after the pull left can judge it: an earlier one may
    have asked before its writer was bound. The first such round that hears a nonce
    makes it the pull's writer (``confirmed``): whichever P took the pull was bound when
    it left, and one bound then but no longer is gone (its port was bound anew).
    """

    nonce: bytes | None = None
    after: int = 0
    confirmed: bool = False

    def ended_by(self, seen: MarkSeen) -> bool:
        """Whether ``seen`` proves this writer gone (and confirms it, if it answers)."""
        if seen.round <= self.after:
            return False
        if seen.nonce is None:
            return self.nonce is not None  # a mark seen, now nothing bound: gone
        if not self.confirmed:
            self.nonce, self.confirmed = seen.nonce, True
            return False
        return seen.nonce != self.nonce


async def _ask_mark(
    worker_addr: str, host: str, port: int, marks: MarkBook, refusal_proves: bool
) -> MarkSeen | None:
    """One round of asking the mark: what it proves, or None (no answer: a stopped or
    busy P proves nothing). A refusal is confirmed at once, but only if it can prove
    something (``refusal_proves``: some writer watched there was seen with a mark);
    otherwise, as for an upstream P that never had one, one ask is the round."""
    round_ = marks.begin_round(worker_addr)
    for refusals in range(1, PROBE_REFUSALS + 1):
        answer, nonce = await ask_writer_mark(host, port, PROBE_CONNECT_TIMEOUT_S)
        if answer == "alive" and nonce is not None:
            marks.saw(worker_addr, nonce)
            return MarkSeen(nonce, round_)
        if answer != "refused" or not refusal_proves:
            return None
        if refusals < PROBE_REFUSALS:
            await asyncio.sleep(PROBE_CONFIRM_S)
    return MarkSeen(None, round_)


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

    A worker that accepts is asked for its writer mark too, and its nonce becomes where
    the pull's :class:`PullWriter` starts: the writer's death is then proof for the
    watch even if it dies before the watch first asks. A mark that refuses (an upstream
    P) leaves nothing recorded; one that does not answer within
    :data:`PREFLIGHT_TIMEOUT_S` (a stopped or busy P) leaves the nonce D had. Either
    way the first watch round after the send settles which writer the pull has.
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
