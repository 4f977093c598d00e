"""What kvfail's connectors take as proof that a P process is gone, and how their probes
close a connection: one rule for every transport's probe (Mooncake's, NIXL's).

Only ``ECONNREFUSED`` counts, and only :data:`PROBE_REFUSALS` in a row: the kernel
refuses a connect only when nothing listens on the port, i.e. the process that owns the
side channel is gone. A slow, busy or SIGSTOPped P keeps its listening socket, so the
kernel completes the connect (or, with a full accept queue, drops the SYN), and silence
is left to the load's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any, Final

__all__ = ["PROBE_REFUSALS", "close_rst", "resolved_socket"]

#: Consecutive refusals that prove P gone. One refusal on loopback or a LAN already means
#: "nothing listens"; the second guards against acting on a single odd answer.
PROBE_REFUSALS: Final = 2

#: ``struct linger`` {on, 0 s}: close() sends RST instead of FIN.
_RST_ON_CLOSE: Final = struct.pack("ii", 1, 0)


def close_rst(sock: socket.socket) -> None:
    """Close with RST: no TIME_WAIT left on D per probe."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST_ON_CLOSE)
    sock.close()


async def resolved_socket(
    host: str, port: int, kind: socket.SocketKind, timeout_s: float
) -> tuple[socket.socket, Any] | None:
    """A new non-blocking socket of ``kind`` for ``host:port``, in the address's own family
    (IPv4 or IPv6), with the address to use; None when the name does not resolve within
    ``timeout_s``.

    An IP literal (what P's workers advertise) is parsed on the loop itself: that lookup
    never waits on a resolver, and the executor's round trip costs the loop thread's
    GIL hand-offs, each of which a busy engine thread can hold up for a switch interval,
    on the pull's path. A host name is looked up on the loop's executor, never blocking
    the loop."""
    try:
        infos = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=kind), timeout_s)
        except (OSError, TimeoutError, UnicodeError):
            return None
    if not infos:
        return None
    family, sock_kind, proto, _, address = infos[0]
    sock = socket.socket(family, sock_kind, proto)
    sock.setblocking(False)
    return sock, address
