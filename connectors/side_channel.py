"""What kvfail's connectors take as proof that a P process is gone, and how their probes
close a connection: one rule for every transport's probe (Mooncake's, NIXL's).

Only ``ECONNREFUSED`` counts, and only :data:`PROBE_REFUSALS` in a row: the kernel
refuses a connect only when nothing listens on the port, i.e. the process that owns the
side channel is gone. A slow, busy or SIGSTOPped P keeps its listening socket, so the
kernel completes the connect (or, with a full accept queue, drops the SYN), and silence
is left to the load's deadline.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Final

__all__ = ["PROBE_REFUSALS", "close_rst"]

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
