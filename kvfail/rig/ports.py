"""Loopback ports for the rig's peers, and a bounded wait for one to listen.

Why a module of its own: every process the rig starts binds a port the rig picked (a P's
bootstrap, a TP world's rendezvous, a fault proxy), and a port picked the wrong way is
taken by some unrelated ``connect()`` before the peer binds it.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvfail.rig.loopback import LOOPBACK, family, require_local

if TYPE_CHECKING:
    from kvfail.rig.processes import PeerProcess

__all__ = ["free_port", "free_ports", "lost_its_port", "wait_for_port"]

#: Its own generator, seeded from the OS: processes that import this at the same moment
#: still pick different ports.
_PORT_RANDOM = random.SystemRandom()

#: Ports are picked at or above this and below the kernel's ephemeral range.
_FIXED_PORT_FLOOR = 10_000

#: Bands that native transports pick from on their own, with a plain bind we cannot see
#: coming: Mooncake's transfer engine takes its RPC port at random in [15000, 17000).
#: A rig port picked there can be taken between our pick and the peer's bind (seen in CI:
#: a TP world's rendezvous failing with EADDRINUSE while Mooncake engines started beside it).
_NATIVE_BANDS: tuple[tuple[int, int], ...] = ((15_000, 17_000),)


def _in_native_band(port: int) -> bool:
    return any(low <= port < high for low, high in _NATIVE_BANDS)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct ports that were free a moment ago, below the ephemeral range.

    Why below it: a port from ``bind(port 0)`` comes from the same range the kernel uses
    for every outgoing connection's local port, so once released it can be taken by any
    ``connect()`` on the machine before the peer binds it (seen in CI: a replacement
    Mooncake P failing its bootstrap bind). Ports under the range are never handed out
    implicitly; only another explicit bind can race us. The bands native transports pick
    from themselves are skipped, and peers that bind the ports we pick retry on a fresh
    one (:class:`kvfail.peers.producer_handle.ProducerHandleBase`,
    :func:`kvfail.harness.workers.start_rank_processes`).
    All are held open together so they differ. Falls back to ``bind(0)`` if the range
    leaves no room under it.
    """
    require_local(host)
    low, _high = _ephemeral_range()
    tries = 64 * n if low - _FIXED_PORT_FLOOR >= 1024 else 0
    socks: list[socket.socket] = []
    try:
        for _ in range(tries):
            if len(socks) == n:
                break
            port = _PORT_RANDOM.randrange(_FIXED_PORT_FLOOR, low)
            if _in_native_band(port) or any(s.getsockname()[1] == port for s in socks):
                continue
            s = socket.socket(family(host), socket.SOCK_STREAM)
            try:
                s.bind((host, port))  # no SO_REUSEADDR: TIME_WAIT leftovers count as taken
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket(family(host), socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def lost_its_port(error: str) -> bool:
    """Whether a peer's start-up error says another bind took the port we picked for it:
    the race :func:`free_ports` cannot close, which its callers answer with a fresh port."""
    text = error.lower()
    return "eaddrinuse" in text or "address already in use" in text


def free_port(host: str = LOOPBACK) -> int:
    """A port on 127.0.0.1 that was free a moment ago (see `free_ports` for the race)."""
    return free_ports(1, host)[0]


def wait_for_port(
    port: int,
    timeout_s: float,
    *,
    host: str = LOOPBACK,
    peer: PeerProcess | None = None,
    interval_s: float = 0.02,
) -> None:
    """Block until a TCP connect to host:port succeeds, or raise TimeoutError.

    A connect succeeds as soon as the socket is listening, even if the owner is frozen (the
    kernel completes the handshake), so this proves "listening", not "serving". Pass `peer`
    to fail at once with PeerExitedError if it dies while we wait.
    """
    require_local(host)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(remaining, 1.0), 0.01)):
                return
        except OSError:
            pass
        if peer is not None and not peer.alive:
            raise peer._exited(f"port {port} accepted")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"nothing accepted on {host}:{port} within {timeout_s}s")
        time.sleep(interval_s)
