"""P loses its port between our pick and its bind: it is started again on a fresh one.

The race is real (CI: a replacement Mooncake P died with ``EADDRINUSE`` on its bootstrap
port), and cannot be closed by any pick, so :class:`ProducerHandleBase` retries. Here a
listener of ours holds the first port handed out, the way a stranger's bind would.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvfail.peers import producer_handle
from kvfail.peers.producer_handle import ProducerHandleBase
from kvfail.rig.ports import _ephemeral_range, free_port, free_ports
from kvfail.rig.processes import PeerExitedError

PORT_ENV = "KVFAIL_TEST_BIND_PORT"


class BindPeer(ProducerHandleBase):
    prefix = "BINDPEER "
    module = "tests.peers.bind_peer"
    transport = "bind"
    port_env = PORT_ENV
    default_connector = "none"

    def _base_env(self) -> dict[str, str]:
        return {"KVFAIL_TEST_PORT_ENV": PORT_ENV}


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", free_port()))
    sock.listen()
    yield sock
    sock.close()


def _hand_out(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> list[int]:
    """Make P's port picks return ``ports`` in order (then real picks)."""
    queue = list(ports)
    monkeypatch.setattr(
        producer_handle, "free_port", lambda: queue.pop(0) if queue else free_port()
    )
    return queue


def test_p_that_lost_its_port_is_restarted_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    held = taken.getsockname()[1]
    _hand_out(monkeypatch, [held])
    p = BindPeer()
    try:
        ready = p.wait_ready(timeout_s=30.0)
        assert ready["port"] == p.port != held
        assert p.process.alive
    finally:
        p.close()


def test_retries_are_bounded_and_the_bind_error_is_raised(
    monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    held = taken.getsockname()[1]
    left = _hand_out(monkeypatch, [held] * (BindPeer.bind_retries + 1))
    p = BindPeer()
    try:
        with pytest.raises(PeerExitedError, match="Address already in use"):
            p.wait_ready(timeout_s=30.0)
        assert left == []  # every retry was spent, no more
    finally:
        p.close()


def test_ports_are_picked_below_the_ephemeral_range() -> None:
    low, _high = _ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(p < low for p in ports), (ports, low)


def test_ports_skip_the_bands_native_transports_pick_from() -> None:
    """Mooncake's transfer engine binds a random port in its own band; a rig port picked
    there can be lost to it between the pick and the peer's bind."""
    from kvfail.rig.ports import _in_native_band

    assert _in_native_band(15_684) and not _in_native_band(17_000)
    assert not any(_in_native_band(p) for p in free_ports(200))
