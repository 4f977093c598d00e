"""Fixtures for the fault-tool tests: a real echo server on loopback, and leak checks."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvfail.rig.processes import live_peers


class EchoServer:
    """A threaded TCP echo server on 127.0.0.1 standing in for the prefill peer P.

    Every blocking call has a short timeout so that stop() is bounded even with clients
    that never hang up.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.connections = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="echo-accept")
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            t = threading.Thread(target=self._echo, args=(conn,), name="echo-conn")
            t.start()
            self._threads.append(t)

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                try:
                    conn.sendall(data)
                except OSError:
                    return

    def stop(self) -> None:
        self._stop.set()
        self._acceptor.join(5)
        with contextlib.suppress(OSError):
            self._sock.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def echo_server() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_leaked_peers() -> Iterator[None]:
    """Every test must close the peers it starts; close_all() alone would hide a leak."""
    yield
    leaked = live_peers()
    for peer in leaked:
        peer.close(grace_s=0.2)
    assert not leaked, f"test leaked peers: {leaked}"
