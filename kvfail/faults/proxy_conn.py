"""One proxied connection of :class:`~kvfail.faults.proxy.FaultProxy`: its two sockets,
the chunks each direction holds until due, and closing a socket with RST.

Apart from the loop because these are records the loop walks, with no behaviour of their
own beyond keeping one direction's chunks in order.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
from collections import deque

# SO_LINGER with a zero timeout makes close() send RST instead of FIN.
_LINGER_RST = struct.pack("ii", 1, 0)


class ConnState(enum.Enum):
    IDLE = enum.auto()  # no upstream yet (accepted while blackholed)
    CONNECTING = enum.auto()
    OPEN = enum.auto()


class Side(enum.Enum):
    CLIENT = enum.auto()
    UPSTREAM = enum.auto()


class Leg:
    """One direction of a proxied connection: chunks waiting for their due time."""

    __slots__ = ("eof", "last_due", "queue", "queued", "shut")

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.eof = False  # the source side sent FIN
        self.shut = False  # FIN forwarded to the destination side
        self.last_due = 0.0  # keeps chunks in order when the delay shrinks mid-stream

    def head_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


class Conn:
    __slots__ = ("client", "closed", "connect_deadline", "down", "state", "up", "upstream")

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.state = ConnState.IDLE
        self.connect_deadline = 0.0
        self.up = Leg()  # client -> upstream
        self.down = Leg()  # upstream -> client
        self.closed = False


def rst_close(sock: socket.socket) -> None:
    """Close with RST: the peer sees ECONNRESET, not a clean EOF, as on a real reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    with contextlib.suppress(OSError):
        sock.close()


def tune(sock: socket.socket) -> None:
    # Without NODELAY, Nagle plus delayed ACKs adds ~40 ms to small request/response
    # exchanges, which would blur the latency the delay mode is meant to add precisely.
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
