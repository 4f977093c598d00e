"""Simulated hosts over real network namespaces: reach, isolation, every kind of partition,
a bandwidth limit, and clean-up that survives a failing test and a killed run.

Everything is checked with real sockets and real ``ip``/``tc`` state, never through the
code under test's own bookkeeping alone.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from kvfail.faults.netns import NETNS_DIR, NamespaceHost, sweep_stale
from kvfail.rig.loopback import require_local
from kvfail.rig.ports import wait_for_port
from kvfail.rig.processes import PeerProcess
from tests.transports import require_netns

require_netns()

#: One xdist worker runs every simulated-host module (with ``tests/peers/test_hosts.py``):
#: namespaces and routes made and removed from two workers at once contend for the kernel's
#: network configuration lock, and one fresh-clone run saw a plain ``ip route del`` wait
#: past its bound while the other worker built its own namespaced pairs.
pytestmark = pytest.mark.xdist_group("simulated-hosts")

READY_S = 30.0  # a bound for a cold interpreter on a loaded machine, never a measurement
PORT = 7411  # a fresh namespace has every port free
#: The server inside the host echoes every connection's bytes back; on "probe PORT" it reports
#: whether the test's own loopback listener is reachable from in there; on "say TEXT" it
#: sends TEXT on every connection it accepted (the host speaking first).
SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    host, port = sys.argv[1], int(sys.argv[2])
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen()
    def serve(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)
    conns = []
    def accept():
        while True:
            c, _ = s.accept()
            conns.append(c)
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "probe":
            try:
                socket.create_connection(("127.0.0.1", int(arg)), timeout=2).close()
                print("probe reached", flush=True)
            except OSError as exc:
                print(f"probe failed {type(exc).__name__}", flush=True)
        elif cmd == "say":
            for c in conns:
                c.sendall(arg.encode())
            print("said", flush=True)
    """
)


@pytest.fixture(params=[4, 6], ids=["ipv4", "ipv6"])
def host(request: pytest.FixtureRequest) -> Iterator[NamespaceHost]:
    """Every check holds on an IPv4 link and on an IPv6-only one."""
    with NamespaceHost(ip_version=request.param) as made:
        assert ipaddress.ip_address(made.inner_addr).version == request.param
        yield made


@pytest.fixture
def server(host: NamespaceHost) -> Iterator[PeerProcess]:
    argv = host.exec_argv([sys.executable, "-c", SERVER, host.inner_addr, str(PORT)])
    with PeerProcess(argv, name="netns-echo", stdin=True) as peer:
        peer.wait_ready(READY_S, line="ready")
        yield peer


def _echo(host: NamespaceHost, payload: bytes) -> bytes:
    with socket.create_connection((host.inner_addr, PORT), timeout=READY_S) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := conn.recv(65536):
            got += chunk
    return bytes(got)


def _connect_gets_no_answer(host: NamespaceHost) -> None:
    """A new connection to the host waits: no refusal, no error, the answer never comes."""
    with pytest.raises(TimeoutError):
        socket.create_connection((host.inner_addr, PORT), timeout=1.0)


def _heals(host: NamespaceHost) -> None:
    """Healed, the host answers over its link again, bytes intact."""
    host.heal()
    assert host.partitioned is None
    assert _echo(host, b"after heal") == b"after heal"


def _links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    return {str(link["ifname"]) for link in json.loads(out.stdout)}


def test_a_host_is_reached_over_its_link_and_is_isolated_from_loopback(
    host: NamespaceHost, server: PeerProcess
) -> None:
    wait_for_port(PORT, READY_S, host=host.inner_addr, peer=server)
    assert _echo(host, b"kv" * 1000) == b"kv" * 1000
    with socket.create_server(("127.0.0.1", 0)) as ours:
        server.write_stdin(f"probe {ours.getsockname()[1]}\n")
        # Inside the host, 127.0.0.1 is the host's own loopback: our listener is not there.
        server.wait_ready(READY_S, line="probe failed ConnectionRefusedError")


def test_a_silent_partition_drops_packets_and_heals(
    host: NamespaceHost, server: PeerProcess
) -> None:
    host.partition("silent")
    assert host.partitioned == "silent"
    _connect_gets_no_answer(host)
    _heals(host)


def test_a_deaf_partition_drops_what_d_sends_while_the_host_still_reaches_d(
    host: NamespaceHost, server: PeerProcess
) -> None:
    """The mirror of the silent cut, on a connection that is up: the host's bytes still
    arrive, ours never reach it (no echo comes back), and a new connect waits."""
    with socket.create_connection((host.inner_addr, PORT), timeout=READY_S) as conn:
        conn.settimeout(READY_S)
        conn.sendall(b"up")
        assert conn.recv(16) == b"up"
        host.partition("deaf")
        assert host.partitioned == "deaf"
        conn.sendall(b"lost")
        server.write_stdin("say from-host\n")
        server.wait_ready(READY_S, line="said")
        assert conn.recv(16) == b"from-host"  # the host's send crossed; no echo came first
        conn.settimeout(1.0)
        with pytest.raises(TimeoutError):  # and our bytes never reached it
            conn.recv(16)
    _connect_gets_no_answer(host)
    _heals(host)


def test_a_refusing_partition_fails_at_once_and_heals(
    host: NamespaceHost, server: PeerProcess
) -> None:
    host.partition("refuse")
    with pytest.raises(OSError) as refused:
        socket.create_connection((host.inner_addr, PORT), timeout=READY_S)
    assert not isinstance(refused.value, TimeoutError)  # an error, not a wait
    _heals(host)


def test_a_bandwidth_limit_shapes_both_ends_and_keeps_bytes_intact(
    host: NamespaceHost, server: PeerProcess
) -> None:
    host.limit("8mbit")
    assert host.qdiscs() == ["tbf", "tbf"]
    payload = bytes(range(256)) * 512
    assert _echo(host, payload) == payload
    host.unlimit()
    assert "tbf" not in host.qdiscs()


def test_close_removes_the_namespace_link_and_addresses_even_when_the_test_fails() -> None:
    with pytest.raises(RuntimeError, match="test body failed"), NamespaceHost() as made:
        name, link, addr = made.name, made.outer_if, made.inner_addr
        assert require_local(addr) == addr
        made.partition("refuse")
        raise RuntimeError("test body failed")
    assert not (NETNS_DIR / name).exists()
    assert link not in _links()
    with pytest.raises(ValueError, match="refusing"):
        require_local(addr)
    routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True, check=True)
    assert addr not in routes.stdout


def test_unknown_addresses_stay_refused() -> None:
    for addr in ("10.213.0.1", "192.168.1.1", "8.8.8.8", "::ffff:10.0.0.1"):
        with pytest.raises(ValueError):
            require_local(addr)
    assert require_local("::1") == "::1"


def test_sweep_removes_what_a_dead_run_left_and_spares_the_living(host: NamespaceHost) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=READY_S)
    stale_ns, stale_if = f"kvf{gone.pid}n0", f"kvf{gone.pid}o0"
    subprocess.run(["ip", "netns", "add", stale_ns], check=True)
    subprocess.run(
        ["ip", "link", "add", stale_if, "type", "veth", "peer", "name", f"kvf{gone.pid}i0"],
        check=True,
    )
    try:
        removed = sweep_stale()
        assert stale_ns in removed and {stale_if, f"kvf{gone.pid}i0"} & set(removed)
        assert not (NETNS_DIR / stale_ns).exists() and stale_if not in _links()
        assert host.exists() and host.outer_if in _links()  # ours: this process lives
    finally:
        subprocess.run(["ip", "netns", "del", stale_ns], capture_output=True)
        subprocess.run(["ip", "link", "del", stale_if], capture_output=True)
