"""Is a P process gone? Non-blocking TCP probes of P side channels, polled at D's drains.

Both NIXL workers need this answer independently of UCX: the pull worker to fail a load
whose P died after the handshake (UCX learns it only when its endpoint fails, which for
a connection still being set up means exhausting its connect retries: seconds to tens
of seconds on a busy machine), the push worker to end the hold on blocks P might still
write.

Only ``ECONNREFUSED`` counts, and only :data:`PROBE_REFUSALS` in a row: the kernel
refuses a connect only when nothing listens on the port, i.e. the process that served
the handshake (P's scheduler, which owns the side channel) is gone. A slow, busy or
SIGSTOPped P keeps its listening socket, so the kernel completes the connect (or, with
a full accept queue, drops the SYN: a pending connect, which counts as nothing). No
probe ever waits: a connect is started at one drain and read back at a later one, one
socket per side channel however many loads wait on it.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import struct
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["PROBE_CONFIRM_S", "PROBE_INTERVAL_S", "PROBE_REFUSALS", "SideChannelProbes"]

#: How often a side channel is probed while loads wait on it (each probe is one SYN).
PROBE_INTERVAL_S: Final = 0.5
#: Consecutive refusals that prove P gone. One refusal on loopback or a LAN already means
#: "nothing listens"; the second guards against acting on a single odd answer.
PROBE_REFUSALS: Final = 2
#: Pause before a refusal is confirmed: short, since a refusal is already an answer.
PROBE_CONFIRM_S: Final = 0.02

#: ``struct linger`` {on, 0 s}: close() sends RST instead of FIN.
_RST_ON_CLOSE: Final = struct.pack("ii", 1, 0)

Address = tuple[str, int]


@dataclass
class _Probe:
    """One side channel's probe state."""

    sock: socket.socket | None = None
    started: float = -1e18
    #: Refusals in a row, and when the first of them came (None: the streak is empty).
    refusals: int = 0
    streak_since: float | None = None
    waiters: set[Hashable] = field(default_factory=set)


class SideChannelProbes:
    """Per-address probes shared by the loads waiting on them; engine thread only."""

    def __init__(
        self,
        interval_s: float = PROBE_INTERVAL_S,
        refusals: int = PROBE_REFUSALS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.refusals = max(1, refusals)
        self._clock = clock
        self._probes: dict[Address, _Probe] = {}

    def gone(self, addr: Address, *, since: float, waiter: Hashable) -> bool:
        """Whether ``addr`` refused :attr:`refusals` connects in a row, the first at or
        after ``since`` (a refusal before a load began may concern an earlier P on the
        same port). Advances the probe by at most one step; never blocks."""
        probe = self._probes.setdefault(addr, _Probe())
        probe.waiters.add(waiter)
        now = self._clock()
        if probe.sock is not None:
            answer = _read(probe.sock)
            if answer is None and now - probe.started < self.interval_s:
                return self._proven(probe, since)
            self._close(probe)
            self._record(probe, answer, now)
        pause = PROBE_CONFIRM_S if probe.refusals else self.interval_s
        if now - probe.started >= pause and not self._proven(probe, since):
            probe.started = now
            answer, probe.sock = _connect(addr)
            if probe.sock is not None:  # on loopback the answer is usually there already
                answer = _read(probe.sock)
                if answer is not None:
                    self._close(probe)
            self._record(probe, answer, now)
        return self._proven(probe, since)

    def forget(self, waiter: Hashable) -> None:
        """Drop ``waiter`` everywhere; a probe nobody waits on is closed."""
        for addr, probe in list(self._probes.items()):
            probe.waiters.discard(waiter)
            if not probe.waiters:
                self._close(probe)
                del self._probes[addr]

    def close(self) -> None:
        for probe in self._probes.values():
            self._close(probe)
        self._probes.clear()

    def __len__(self) -> int:
        return len(self._probes)

    # ------------------------------------------------------------------ internals

    def _proven(self, probe: _Probe, since: float) -> bool:
        return (
            probe.refusals >= self.refusals
            and probe.streak_since is not None
            and probe.streak_since >= since
        )

    @staticmethod
    def _record(probe: _Probe, answer: int | None, now: float) -> None:
        """A refusal extends the streak; an accepted connect ends it; no answer (still
        pending, or dropped after the interval) or another error says nothing."""
        if answer == errno.ECONNREFUSED:
            if probe.refusals == 0:
                probe.streak_since = now
            probe.refusals += 1
        elif answer == 0:
            probe.refusals, probe.streak_since = 0, None

    @staticmethod
    def _close(probe: _Probe) -> None:
        if probe.sock is not None:
            _close_rst(probe.sock)
            probe.sock = None


def _connect(addr: Address) -> tuple[int | None, socket.socket | None]:
    """Start a non-blocking connect: (None, the pending socket), or (its outcome, None)
    when the kernel answered at once (0 accepted; loopback refuses at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    code = sock.connect_ex(addr)
    if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
        return None, sock
    _close_rst(sock)
    return code, None


def _read(sock: socket.socket) -> int | None:
    """A pending connect's outcome: 0 accepted, an errno, or None while pending.

    ``poll``, not ``select``: a D process holds many descriptors (UCX, zmq, its peers'
    pipes), and ``select`` raises for any descriptor numbered past FD_SETSIZE (1024),
    which would crash the drain that probes."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    if not poller.poll(0):
        return None
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)


def _close_rst(sock: socket.socket) -> None:
    """Close with RST, not FIN: a probe every interval must not pile up TIME_WAIT."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST_ON_CLOSE)
    sock.close()
