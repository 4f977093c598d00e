"""Is a P process gone? Non-blocking TCP probes of P side channels, polled at D's drains.

Both NIXL workers need this answer independently of UCX: the pull worker to fail a load
whose P died after the handshake (UCX learns it only when its endpoint fails, which for
a connection still being set up means exhausting its connect retries: seconds to tens
of seconds on a busy machine), the push worker to end the hold on blocks P might still
write.

What counts as gone is the rule of :mod:`connectors.side_channel`: only
``ECONNREFUSED``, and only :data:`PROBE_REFUSALS` in a row. The kernel
refuses a connect only when nothing listens on the port, i.e. the process that served
the handshake (P's scheduler, which owns the side channel) is gone. A slow, busy or
SIGSTOPped P keeps its listening socket, so the kernel completes the connect (or, with
a full accept queue, drops the SYN: a pending connect, which counts as nothing). No
probe ever waits: a connect is started at one drain and read back at a later one, one
socket per side channel however many loads wait on it.

Addresses: an IPv4 or IPv6 literal (``::1`` or ``[::1]``) is connected to as is; a host
name is resolved off the engine thread (a daemon thread per lookup, at most one per side
channel at a time) before each round, since ``getaddrinfo`` blocks for as long as the
resolver takes. A name that stops resolving proves nothing about P's process, so it
never counts as gone; :meth:`SideChannelProbes.unresolved` says so, for the worker to
report it (a pull fails its loads; a push hold stays, see the connector README).
"""

from __future__ import annotations

import errno
import ipaddress
import select
import socket
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final

from connectors.side_channel import PROBE_REFUSALS, close_rst

__all__ = ["PROBE_CONFIRM_S", "PROBE_INTERVAL_S", "PROBE_REFUSALS", "SideChannelProbes"]

#: How often a side channel is probed while loads wait on it (each probe is one SYN).
PROBE_INTERVAL_S: Final = 0.5
#: Pause before a refusal is confirmed: short, since a refusal is already an answer.
PROBE_CONFIRM_S: Final = 0.02

Address = tuple[str, int]
#: What a connect is given: the socket family and its address tuple.
Target = tuple[int, tuple[object, ...]]


class _Lookup:
    """One ``getaddrinfo`` on a daemon thread: the engine thread only reads its outcome.

    A daemon thread, not a pool: a lookup stuck in the resolver must not hold up the
    interpreter's exit, and at most one runs per side channel."""

    def __init__(self, host: str, port: int) -> None:
        self.target: Target | None = None
        self.error: str | None = None
        self._done = threading.Event()
        threading.Thread(
            target=self._run, args=(host, port), name="kvfail-probe-dns", daemon=True
        ).start()

    def _run(self, host: str, port: int) -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            if not infos:
                raise socket.gaierror(f"no address for {host!r}")
            family, _, _, _, sockaddr = infos[0]
            self.target = (int(family), tuple(sockaddr))
        except (OSError, UnicodeError) as exc:  # gaierror is an OSError
            self.error = f"{host!r} does not resolve: {exc}"
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()


def literal_target(addr: Address) -> Target | None:
    """``addr`` as a connect target if its host is an IP literal (no lookup), else None."""
    host = addr[0].strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6:
        return socket.AF_INET6, (str(ip), int(addr[1]), 0, 0)
    return socket.AF_INET, (str(ip), int(addr[1]))


@dataclass
class _Streak:
    """Answers of one kind in a row, and when the first of them came (None: empty).

    Why a ``since``: a streak speaks only for a waiter that began before it; one that
    began earlier may be about another P on the port, or a name since resolved again."""

    count: int = 0
    since: float | None = None

    def extend(self, at: float) -> None:
        if self.count == 0:
            self.since = at
        self.count += 1

    def end(self) -> None:
        self.count, self.since = 0, None

    def holds(self, count: int, since: float) -> bool:
        """At least ``count`` in a row, the first at or after ``since``."""
        return self.count >= count and self.since is not None and self.since >= since


@dataclass
class _Probe:
    """One side channel's probe state."""

    sock: socket.socket | None = None
    started: float = -1e18
    #: Connects refused in a row.
    refused: _Streak = field(default_factory=_Streak)
    waiters: set[Hashable] = field(default_factory=set)
    #: A host name's lookup in flight for this round (None for a literal address).
    lookup: _Lookup | None = None
    #: Lookups of the host name failed in a row (each dated when it began), and why the
    #: last one failed (None: it resolved, or a literal).
    unresolved: _Streak = field(default_factory=_Streak)
    unresolved_why: str | None = None


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
        # Called for every waiting load at every drain: build a probe only when none is
        # there (``setdefault`` would build and drop one per call, on the engine thread).
        probe = self._probes.get(addr)
        if probe is None:
            probe = self._probes[addr] = _Probe()
        probe.waiters.add(waiter)
        now = self._clock()
        if probe.sock is not None:
            answer = _read(probe.sock)
            if answer is None and now - probe.started < self.interval_s:
                return self._proven(probe, since)
            self._close(probe)
            self._record(probe, answer, now)
        pause = PROBE_CONFIRM_S if probe.refused.count else self.interval_s
        if probe.lookup is None and now - probe.started >= pause and not self._proven(probe, since):
            probe.started = now
            target = literal_target(addr)
            if target is None:
                probe.lookup = _Lookup(addr[0], int(addr[1]))
            else:
                self._connect(probe, target, now)
        if probe.lookup is not None and probe.lookup.done():
            lookup, probe.lookup = probe.lookup, None
            probe.unresolved_why = lookup.error
            if lookup.error is None:
                probe.unresolved.end()
            else:
                probe.unresolved.extend(probe.started)  # when this lookup began
            if lookup.target is not None:
                self._connect(probe, lookup.target, now)
        return self._proven(probe, since)

    def unresolved(self, addr: Address, *, since: float) -> str | None:
        """Why ``addr``'s host name failed to resolve at :attr:`refusals` lookups in a
        row (one odd answer is not enough), the first begun at or after ``since``, else
        None. Not proof that P is gone: a resolver can fail while P keeps running.

        ``since``, as for :meth:`gone`: lookups that failed before a load began say
        nothing of the name now (it may resolve again), and a load that began after them
        would be failed at once, on another load's stale answer."""
        probe = self._probes.get(addr)
        if probe is None or not probe.unresolved.holds(self.refusals, since):
            return None
        return probe.unresolved_why

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

    def _connect(self, probe: _Probe, target: Target, now: float) -> None:
        answer, probe.sock = _connect(target)
        if probe.sock is not None:  # on loopback the answer is usually there already
            answer = _read(probe.sock)
            if answer is not None:
                self._close(probe)
        self._record(probe, answer, now)

    def _proven(self, probe: _Probe, since: float) -> bool:
        return probe.refused.holds(self.refusals, since)

    @staticmethod
    def _record(probe: _Probe, answer: int | None, now: float) -> None:
        """A refusal extends the streak; an accepted connect ends it; no answer (still
        pending, or dropped after the interval) or another error says nothing."""
        if answer == errno.ECONNREFUSED:
            probe.refused.extend(now)
        elif answer == 0:
            probe.refused.end()

    @staticmethod
    def _close(probe: _Probe) -> None:
        if probe.sock is not None:
            close_rst(probe.sock)
            probe.sock = None


def _connect(target: Target) -> tuple[int | None, socket.socket | None]:
    """Start a non-blocking connect: (None, the pending socket), or (its outcome, None)
    when the kernel answered at once (0 accepted; loopback refuses at once). The target
    is already an address, so nothing here looks a name up."""
    family, sockaddr = target
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:  # e.g. no IPv6 on this host: an answer that proves nothing
        return (exc.errno or errno.EAFNOSUPPORT), None
    sock.setblocking(False)
    try:
        code = sock.connect_ex(sockaddr)
    except OSError as exc:
        code = exc.errno or errno.EINVAL
    if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
        return None, sock
    close_rst(sock)
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
