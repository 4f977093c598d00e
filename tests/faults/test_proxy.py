"""FaultProxy against a real echo server on loopback.

No assertion reads the wall clock: the delay mode is checked on a clock the test moves,
and "nothing arrives" is the only claim that waits (a short, fixed silence).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvfail.faults import FaultProxy, ProxyMode, proxy_loop
from kvfail.rig.ports import free_port
from tests.core.fakes import ManualClock
from tests.waiting import wait_until

# Generous: only hit when something is broken, so they cost nothing on a green run.
IO_TIMEOUT_S = 5.0
# Short on purpose: "nothing arrives" is checked by waiting this long and seeing nothing.
SILENCE_S = 0.3


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(sock: socket.socket, n: int, timeout_s: float = IO_TIMEOUT_S) -> bytes:
    sock.settimeout(timeout_s)
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def echo_roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    return recv_exact(sock, len(payload))


def assert_reset(sock: socket.socket) -> None:
    """The client must see the connection die (RST, or at least EOF) well within the bound."""
    sock.settimeout(IO_TIMEOUT_S)
    try:
        sock.sendall(b"x")
        data = sock.recv(1)
    except (ConnectionResetError, BrokenPipeError):
        return
    assert data == b"", f"expected reset/EOF, got {data!r}"


def assert_connect_reset(port: int) -> None:
    """A connect the proxy RSTs: the RST may beat connect()'s return, or come just after."""
    try:
        sock = connect(port)
    except ConnectionResetError:
        return
    with sock:
        assert_reset(sock)


@pytest.fixture
def proxy(echo_server) -> Iterator[FaultProxy]:  # type: ignore[no-untyped-def]
    with FaultProxy(echo_server.port) as p:
        yield p


def test_pass_forwards_both_ways_and_counts(proxy: FaultProxy) -> None:
    payload = os.urandom(300_000)  # several chunks and a partial-write path
    with connect(proxy.port) as c:
        assert echo_roundtrip(c, payload) == payload
    stats = proxy.wait_stats(lambda s: s.bytes_to_client == len(payload))
    assert stats.accepted == 1
    assert stats.bytes_to_upstream == len(payload)
    assert stats.mode is ProxyMode.PASS
    assert proxy.address == ("127.0.0.1", proxy.port)


def test_half_close_is_forwarded(proxy: FaultProxy) -> None:
    with connect(proxy.port) as c:
        c.sendall(b"last words")
        c.shutdown(socket.SHUT_WR)
        # The echo server sees our FIN only through the proxy, echoes, then closes.
        assert recv_exact(c, 10) == b"last words"
        assert c.recv(1) == b""
    assert proxy.wait_stats(lambda s: s.active == 0).aborted == 0


def test_reset_kills_live_and_new_connections(proxy: FaultProxy) -> None:
    with connect(proxy.port) as live:
        assert echo_roundtrip(live, b"hello") == b"hello"
        proxy.reset()  # returns only once every live connection has been RST
        assert proxy.stats().active == 0
        assert_reset(live)
    assert_connect_reset(proxy.port)  # the kernel completes the handshake; then RST
    stats = proxy.stats()
    assert stats.accepted == 2
    assert stats.aborted == 2


def test_blackhole_is_silent_but_keeps_connections_open(proxy: FaultProxy, echo_server) -> None:  # type: ignore[no-untyped-def]
    with connect(proxy.port) as live:
        assert echo_roundtrip(live, b"warm") == b"warm"
        proxy.blackhole()
        sent_before = proxy.bytes_to_upstream
        live.sendall(b"ping")
        live.settimeout(SILENCE_S)
        with pytest.raises(TimeoutError):
            live.recv(1)
        assert proxy.bytes_to_upstream == sent_before

        with connect(proxy.port) as new:  # accepted, but P is never contacted
            new.sendall(b"pong")
            new.settimeout(SILENCE_S)
            with pytest.raises(TimeoutError):
                new.recv(1)
            assert proxy.stats().active == 2
            assert echo_server.connections == 1

            # Still open: back in pass mode, what was held is delivered, in order.
            proxy.pass_through()
            assert recv_exact(live, 4) == b"ping"
            assert recv_exact(new, 4) == b"pong"
            assert echo_roundtrip(new, b"more") == b"more"


def held_bytes(proxy: FaultProxy) -> int:
    """Bytes the proxy has read and not yet forwarded, both directions (its queues)."""
    return sum(conn.up.queued + conn.down.queued for conn in list(proxy._conns))


def loop_pass(proxy: FaultProxy) -> None:
    """Return after the proxy's loop has run at least one full pass (select included)."""
    for _ in range(2):  # a command is applied at the top of a pass: two span a whole one
        proxy.set_mode(proxy.mode, proxy.delay_s)


def held_until_due(proxy: FaultProxy, clock: ManualClock, counter: str) -> None:
    """The one chunk the proxy holds goes out only once the clock reaches its due time."""
    assert wait_until(lambda: held_bytes(proxy) == 4), f"{counter}: the proxy never held the chunk"
    before = getattr(proxy.stats(), counter)
    clock.advance(proxy.delay_s / 2)
    loop_pass(proxy)
    assert getattr(proxy.stats(), counter) == before, f"{counter}: forwarded before due"
    assert held_bytes(proxy) == 4, f"{counter}: the held chunk was lost"
    clock.advance(proxy.delay_s / 2)
    loop_pass(proxy)
    assert wait_until(lambda: getattr(proxy.stats(), counter) == before + 4), (
        f"{counter}: a due chunk was never forwarded"
    )


def test_delay_holds_each_chunk_until_due_in_both_directions(
    proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The proxy's clock stands still unless the test moves it, so "delayed" is checked as
    # an order of events, not as seconds measured on a loaded machine.
    clock = ManualClock()
    monkeypatch.setattr(proxy_loop, "time", SimpleNamespace(monotonic=clock, sleep=time.sleep))
    with connect(proxy.port) as c:
        assert echo_roundtrip(c, b"warm") == b"warm"  # pass mode: due as soon as read
        proxy.delay(0.25)
        assert proxy.mode is ProxyMode.DELAY and proxy.delay_s == 0.25
        c.sendall(b"slow")
        held_until_due(proxy, clock, "bytes_to_upstream")
        held_until_due(proxy, clock, "bytes_to_client")  # P's echo, delayed once more
        assert recv_exact(c, 4) == b"slow"
        proxy.pass_through()
        assert echo_roundtrip(c, b"fast") == b"fast"


def test_delay_preserves_order_of_many_chunks(proxy: FaultProxy) -> None:
    proxy.delay(0.05)
    payload = b"".join(i.to_bytes(4, "big") for i in range(50_000))
    with connect(proxy.port) as c:
        sender = threading.Thread(target=c.sendall, args=(payload,))
        sender.start()
        try:
            assert recv_exact(c, len(payload)) == payload
        finally:
            sender.join(IO_TIMEOUT_S)


def test_refuse_then_pass_on_same_port(proxy: FaultProxy) -> None:
    port = proxy.port
    with connect(port) as live:
        assert echo_roundtrip(live, b"a") == b"a"
        proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            connect(port)
        # Connections opened before keep working: only new connects are refused.
        assert echo_roundtrip(live, b"b") == b"b"
        proxy.pass_through()
    assert proxy.port == port
    with connect(port) as again:
        assert echo_roundtrip(again, b"c") == b"c"


def test_start_in_refuse_mode_reserves_the_port(echo_server) -> None:  # type: ignore[no-untyped-def]
    with FaultProxy(echo_server.port, mode="refuse") as p:
        with pytest.raises(ConnectionRefusedError):
            connect(p.port)
        p.set_mode("pass")
        with connect(p.port) as c:
            assert echo_roundtrip(c, b"up") == b"up"


def test_mode_switches_with_live_connections(proxy: FaultProxy) -> None:
    conns = [connect(proxy.port) for _ in range(4)]
    try:
        modes: list[tuple[ProxyMode, float | None]] = [
            (ProxyMode.PASS, None),
            (ProxyMode.DELAY, 0.02),
            (ProxyMode.REFUSE, None),
            (ProxyMode.PASS, None),
        ]
        for round_no, (mode, delay) in enumerate(modes):
            proxy.set_mode(mode, delay)
            for i, c in enumerate(conns):
                msg = f"{round_no}:{i}".encode()
                assert echo_roundtrip(c, msg) == msg
        proxy.blackhole()
        for c in conns:
            c.sendall(b"held")
        proxy.pass_through()
        for c in conns:
            assert recv_exact(c, 4) == b"held"
        proxy.reset()
        for c in conns:
            assert_reset(c)
    finally:
        for c in conns:
            c.close()


def test_upstream_down_resets_client(echo_server) -> None:  # type: ignore[no-untyped-def]
    dead_port = free_port()  # nothing listens there
    with FaultProxy(dead_port) as p:
        assert_connect_reset(p.port)
        assert p.wait_stats(lambda s: s.upstream_failures == 1).active == 0
        # Pointing at a live peer (a restarted P) repairs new connections.
        p.set_upstream(echo_server.port)
        with connect(p.port) as c2:
            assert echo_roundtrip(c2, b"back") == b"back"


def test_close_joins_thread_and_closes_everything(echo_server) -> None:  # type: ignore[no-untyped-def]
    baseline = threading.active_count()
    p = FaultProxy(echo_server.port).start()
    conns = [connect(p.port) for _ in range(3)]
    try:
        for c in conns:
            assert echo_roundtrip(c, b"x") == b"x"
        p.blackhole()  # close() must not wait on a silent connection
        p.close()
        assert not any(t.name.startswith("kvfail-proxy") for t in threading.enumerate())
        for c in conns:
            assert_reset(c)
    finally:
        for c in conns:
            c.close()
    # The echo server's per-connection threads end once the proxy's side is gone.
    assert wait_until(lambda: threading.active_count() <= baseline), threading.enumerate()
    with pytest.raises(ConnectionRefusedError):
        connect(p.port)
    with pytest.raises(RuntimeError):
        p.reset()
    p.close()  # idempotent


def test_rejects_non_loopback_and_bad_delay() -> None:
    with pytest.raises(ValueError):
        FaultProxy(80, "10.0.0.1")
    with pytest.raises(ValueError):
        FaultProxy(80, "localhost")  # names are not resolved
    with pytest.raises(ValueError):
        FaultProxy(80, delay_s=-1)
    with pytest.raises(ValueError):
        FaultProxy(80, mode="drop")
