"""The side-channel probe both NIXL workers use to learn that a P process is gone.

Real TCP on 127.0.0.1: a listening socket stands for a live P's side channel, a port
nobody listens on for a gone one. A fake clock steps past the probe's pauses, so the
tests count probe steps, never wall-clock time.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from connectors.nixl.probe import PROBE_CONFIRM_S, PROBE_REFUSALS, SideChannelProbes
from kvfail.peers.base import closed_port
from tests.core.fakes import ManualClock

INTERVAL_S = 0.5
#: Descriptors the FD_SETSIZE test opens first.
HIGH_FDS = 1100


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


def _steps_until_gone(
    probes: SideChannelProbes, clock: ManualClock, addr: tuple[str, int], since: float, limit: int
) -> int | None:
    """Poll as drains would, stepping past each pause; the step that proved P gone."""
    for step in range(1, limit + 1):
        if probes.gone(addr, since=since, waiter="r"):
            return step
        clock.now += max(INTERVAL_S, PROBE_CONFIRM_S)
    return None


def test_a_port_nobody_listens_on_is_gone_after_the_refusals_in_a_row() -> None:
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = ("127.0.0.1", closed_port())
    assert not probes.gone(addr, since=clock.now, waiter="r")  # one refusal proves nothing
    step = _steps_until_gone(probes, clock, addr, clock.now - 1, limit=10)
    assert step is not None and step <= PROBE_REFUSALS
    probes.close()


def test_a_listening_side_channel_is_never_gone(listener: socket.socket) -> None:
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = listener.getsockname()
    assert _steps_until_gone(probes, clock, addr, clock.now, limit=20) is None
    probes.close()


def test_an_accepted_connect_breaks_the_streak(listener: socket.socket) -> None:
    """Refused, then accepted (a P back on its port), then refused: the streak restarts,
    so one refusal after the accept is not enough."""
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, refusals=2, clock=clock)
    host, port = listener.getsockname()
    listener.close()
    since = clock.now
    assert not probes.gone((host, port), since=since, waiter="r")  # refused: 1 of 2
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind((host, port))
        again.listen(8)
        for _ in range(3):  # accepted (at once, or read back at the next poll)
            clock.now += INTERVAL_S
            assert not probes.gone((host, port), since=since, waiter="r")
    clock.now += INTERVAL_S
    assert not probes.gone((host, port), since=since, waiter="r")  # refused: 1 of 2 again
    clock.now += 2 * PROBE_CONFIRM_S
    assert probes.gone((host, port), since=since, waiter="r")
    probes.close()


def test_refusals_before_since_do_not_count() -> None:
    """A load that began after P's port started refusing needs refusals of its own."""
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = ("127.0.0.1", closed_port())
    assert _steps_until_gone(probes, clock, addr, clock.now - 1, limit=10) is not None
    later = clock.now + 1
    assert not probes.gone(addr, since=later, waiter="r2")


def test_a_probe_nobody_waits_on_is_closed() -> None:
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = ("127.0.0.1", closed_port())
    probes.gone(addr, since=clock.now, waiter="a")
    probes.gone(addr, since=clock.now, waiter="b")
    assert len(probes) == 1  # one probe per side channel, however many loads wait
    probes.forget("a")
    assert len(probes) == 1
    probes.forget("b")
    assert len(probes) == 0


def test_a_probe_whose_socket_is_numbered_past_fd_setsize_still_answers(
    listener: socket.socket,
) -> None:
    """A D process holds many descriptors; a probe socket numbered past 1024 (where
    ``select`` raises) is read like any other, so the drain that probes never crashes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < HIGH_FDS + 64:
        pytest.skip(f"this process may open {soft} descriptors; the test needs {HIGH_FDS + 64}")
    # Fill every free number below HIGH_FDS: the probe's socket is then numbered above it.
    held = [socket.socket() for _ in range(HIGH_FDS)]
    try:
        assert min(s.fileno() for s in held[-8:]) > 1024
        clock = ManualClock()
        probes = SideChannelProbes(INTERVAL_S, clock=clock)
        addr = ("127.0.0.1", closed_port())
        assert _steps_until_gone(probes, clock, addr, clock.now - 1, limit=10) is not None
        alive = listener.getsockname()
        assert _steps_until_gone(probes, clock, alive, clock.now, limit=6) is None
        probes.close()
    finally:
        for s in held:
            s.close()


# ---------------------------------------------------------------- IPv6 and host names


def _v6_or_skip() -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    return sock


def _wait_for_lookup(probes: SideChannelProbes, clock: ManualClock, addr: tuple[str, int]) -> None:
    """Poll as drains would until the lookups in flight have answered (real threads,
    so a bounded real wait; the fake clock still paces the rounds)."""
    import time

    end = time.monotonic() + 10.0
    while probes.unresolved(addr, since=-1e18) is None:
        assert time.monotonic() < end, "the name's lookups never answered"
        assert not probes.gone(addr, since=clock.now - 1, waiter="r")
        clock.now += INTERVAL_S
        time.sleep(0.01)


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_side_channel_is_probed(host: str) -> None:
    """A P on IPv6 loopback: listening, it is never gone; closed, it is gone (the probe
    used an IPv4 socket, and ``connect_ex`` raised ``gaierror`` into D's drain)."""
    listener = _v6_or_skip()
    listener.listen(8)
    port = int(listener.getsockname()[1])
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    try:
        assert _steps_until_gone(probes, clock, (host, port), clock.now, limit=6) is None
        assert probes.unresolved((host, port), since=-1e18) is None  # a literal is never looked up
        listener.close()
        since = clock.now
        assert _steps_until_gone(probes, clock, (host, port), since, limit=10) is not None
    finally:
        listener.close()
        probes.close()


def test_a_host_name_is_resolved_off_the_drain() -> None:
    """``localhost`` is looked up on a thread; the drain that starts the lookup does not
    wait for it, and the answer is used at later drains: a closed port is found gone."""
    import time

    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = ("localhost", closed_port())
    assert not probes.gone(addr, since=clock.now - 1, waiter="r")  # lookup started only
    end = time.monotonic() + 10.0
    while not probes.gone(addr, since=clock.now - 100, waiter="r"):
        assert time.monotonic() < end, "a closed port named by a host name was never gone"
        clock.now += INTERVAL_S
        time.sleep(0.01)
    assert probes.unresolved(addr, since=-1e18) is None
    probes.close()


def test_a_name_that_stops_resolving_is_reported_never_gone(unresolvable_name: str) -> None:
    """A name that does not resolve raises nothing into the drain, never proves P gone
    (a resolver can fail while P runs), and is reported once lookups fail in a row."""
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = (unresolvable_name, closed_port())
    _wait_for_lookup(probes, clock, addr)
    reason = probes.unresolved(addr, since=-1e18)
    assert reason is not None and unresolvable_name in reason
    assert not probes.gone(addr, since=clock.now - 100, waiter="r")
    probes.close()


def test_failed_lookups_before_since_do_not_count(unresolvable_name: str) -> None:
    """A load that begins after another load's lookups failed is not failed on their
    stale answer: the name may resolve again, and only lookups begun after the load
    began speak for it (seen: once a name had failed for one load, the next load to
    the same P failed at once, though the name resolved again)."""
    clock = ManualClock()
    probes = SideChannelProbes(INTERVAL_S, clock=clock)
    addr = (unresolvable_name, closed_port())
    _wait_for_lookup(probes, clock, addr)
    assert probes.unresolved(addr, since=-1e18) is not None
    clock.now += 1.0
    assert probes.unresolved(addr, since=clock.now) is None
    probes.close()
