"""Proof that a load's P is gone: its advertised address refuses a TCP connection.

Real sockets on 127.0.0.1: a listening one accepts (P alive, or frozen: the kernel still
accepts), a closed port refuses (nothing listens there any more).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from connectors.guard.peer import peer_address, peer_refuses


@pytest.fixture
def listening() -> Iterator[tuple[str, int]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        yield server.getsockname()
    finally:
        server.close()


def _closed_port() -> tuple[str, int]:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    address = probe.getsockname()
    probe.close()
    return address


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"remote_bootstrap_addr": "127.0.0.1:8998"}, ("127.0.0.1", 8998)),
        ({"remote_bootstrap_addr": "http://127.0.0.1:8998"}, ("127.0.0.1", 8998)),
        ({"remote_host": "127.0.0.1", "remote_port": 5600}, ("127.0.0.1", 5600)),
        ({"remote_bootstrap_addr": "127.0.0.1:not-a-port"}, None),
        ({"remote_host": "127.0.0.1", "remote_port": "5600"}, None),
        ({"do_remote_prefill": True}, None),
        (None, None),
        ("not a mapping", None),
    ],
)
def test_peer_address_from_params(params: object, expected: object) -> None:
    assert peer_address(params) == expected  # type: ignore[arg-type]


def test_a_listening_peer_is_not_proven_gone(listening: tuple[str, int]) -> None:
    assert not peer_refuses(listening, timeout_s=2.0)


def test_a_closed_port_proves_the_peer_gone() -> None:
    assert peer_refuses(_closed_port(), timeout_s=2.0)
