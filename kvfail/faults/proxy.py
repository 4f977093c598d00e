"""A loopback TCP proxy that injects network faults between D and P at run time.

Transports react very differently to a dead, a silent and a slow peer (Mooncake fails in
1 ms on a refused port but needs 60 s on a silent one; NIXL never notices a silent peer).
Killing a process only produces some of those signals, so this proxy produces the rest on
the wire itself: it sits on the path D -> P and can switch, while connections are live,
between forwarding, resetting (RST), swallowing (a silent peer whose sockets stay open),
delaying, and refusing new connections on the same port.

One background thread runs a `selectors` loop over non-blocking sockets. Mode changes are
sent to that thread as commands and `set_mode` returns only once the loop has applied them,
so a test can rely on "after `proxy.reset()` returns, every live connection has been
RST" without sleeping. Every wait in this module is bounded. The loop thread's half is
:mod:`kvfail.faults.proxy_loop`; one connection's records are :mod:`kvfail.faults.proxy_conn`.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfail.faults.proxy_conn import Conn
from kvfail.faults.proxy_loop import Command, ProxyLoop, ProxyMode
from kvfail.rig.closing import ClosesOnExit
from kvfail.rig.loopback import LOOPBACK, require_local

__all__ = ["FaultProxy", "ProxyMode", "ProxyStats"]


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """One consistent snapshot of the counters, so assertions never mix two moments."""

    mode: ProxyMode
    delay_s: float
    accepted: int
    """Connections accepted since start (including ones RST at once in reset mode)."""
    active: int
    """Connections currently held open by the proxy."""
    bytes_to_upstream: int
    """Bytes written to the upstream (P) side."""
    bytes_to_client: int
    """Bytes written back to the client (D) side."""
    aborted: int
    """Connections the proxy closed with RST (reset mode, a side's error, close())."""
    upstream_failures: int
    """Upstream connects that were refused, failed or timed out."""


class FaultProxy(ClosesOnExit, ProxyLoop):
    """A TCP proxy on 127.0.0.1 whose behaviour can be switched while connections are live.

    Modes (new connections / connections already open):

    - ``pass``: forward both ways.
    - ``reset``: RST every live connection (both sides) when entered; accept and RST new ones.
    - ``blackhole``: accept and hold new connections without contacting upstream; stop
      reading and writing on open ones. Nothing is closed: a silent peer. Data already read
      stays queued and is delivered if the mode later returns to ``pass``.
    - ``delay``: forward, but deliver each chunk ``delay_s`` seconds after it was read
      (added latency, not a bandwidth limit; order is preserved).
    - ``refuse``: stop listening (connects get ECONNREFUSED) while keeping the port bound so
      nothing else can take it; open connections keep forwarding. Leaving ``refuse``
      listens again on the same port.
    """

    def __init__(
        self,
        upstream_port: int,
        upstream_host: str = LOOPBACK,
        *,
        listen_port: int = 0,
        mode: ProxyMode | str = ProxyMode.PASS,
        delay_s: float = 0.0,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 5.0,
        name: str = "kvfail-proxy",
    ) -> None:
        self._upstream = (require_local(upstream_host), int(upstream_port))
        self._listen_port = int(listen_port)
        self._mode = ProxyMode(mode)
        self._delay_s = self._check_delay(delay_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._control_timeout_s = float(control_timeout_s)
        self._name = name

        self._lock = threading.Lock()  # guards the counters and the fields above
        self._accepted = 0
        self._bytes_up = 0
        self._bytes_down = 0
        self._aborted = 0
        self._upstream_failures = 0

        self._port: int | None = None
        self._lsock: socket.socket | None = None
        self._listening = False
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._conns: set[Conn] = set()
        self._masks: dict[socket.socket, int] = {}
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._loop_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        """Bind in the caller's thread (so bind errors and `.port` are immediate), then run."""
        if self._closed:
            raise RuntimeError("proxy already closed")
        if self._thread is not None:
            return self
        self._lsock = self._bind(self._listen_port)
        self._port = self._lsock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        if self._mode is not ProxyMode.REFUSE:
            self._listen()
        self._thread = threading.Thread(
            target=self._run, name=f"{self._name}:{self._port}", daemon=True
        )
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop, RST every connection, close every socket and join the thread.

        Connections are RST rather than FIN-closed so no socket lingers in the kernel after
        a test and the listening port can be reused at once.
        """
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._wake()
        thread.join(timeout_s)
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        if thread.is_alive():
            raise TimeoutError(f"{self._name}: loop thread did not stop within {timeout_s}s")

    def __enter__(self) -> FaultProxy:
        return self.start()

    # ------------------------------------------------------------------ public state

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("proxy not started")
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """Where D should connect instead of P."""
        return (LOOPBACK, self.port)

    @property
    def upstream(self) -> tuple[str, int]:
        with self._lock:
            return self._upstream

    @property
    def mode(self) -> ProxyMode:
        with self._lock:
            return self._mode

    @property
    def delay_s(self) -> float:
        with self._lock:
            return self._delay_s

    @property
    def connections_accepted(self) -> int:
        with self._lock:
            return self._accepted

    @property
    def bytes_to_upstream(self) -> int:
        with self._lock:
            return self._bytes_up

    @property
    def bytes_to_client(self) -> int:
        with self._lock:
            return self._bytes_down

    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(
                mode=self._mode,
                delay_s=self._delay_s,
                accepted=self._accepted,
                active=len(self._conns),
                bytes_to_upstream=self._bytes_up,
                bytes_to_client=self._bytes_down,
                aborted=self._aborted,
                upstream_failures=self._upstream_failures,
            )

    def wait_stats(
        self, predicate: Callable[[ProxyStats], bool], timeout_s: float = 5.0
    ) -> ProxyStats:
        """Poll the counters until `predicate` holds; lets tests sync on the loop, not sleep."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.stats()
            if predicate(snap):
                return snap
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._name}: condition not met within {timeout_s}s: {snap}")
            time.sleep(0.005)

    # ------------------------------------------------------------------ control

    def set_mode(self, mode: ProxyMode | str, delay_s: float | None = None) -> None:
        """Switch mode; returns once the loop has applied it (bounded by control_timeout_s)."""
        new_mode = ProxyMode(mode)
        new_delay = self.delay_s if delay_s is None else self._check_delay(delay_s)
        self._control(lambda: self._apply_mode(new_mode, new_delay))

    def pass_through(self) -> None:
        self.set_mode(ProxyMode.PASS)

    def reset(self) -> None:
        self.set_mode(ProxyMode.RESET)

    def blackhole(self) -> None:
        self.set_mode(ProxyMode.BLACKHOLE)

    def delay(self, seconds: float) -> None:
        self.set_mode(ProxyMode.DELAY, seconds)

    def refuse(self) -> None:
        self.set_mode(ProxyMode.REFUSE)

    def set_upstream(self, port: int, host: str = LOOPBACK) -> None:
        """Point new connections at another upstream, e.g. a peer restarted on a new port."""
        target = (require_local(host), int(port))

        def apply() -> None:
            with self._lock:
                self._upstream = target

        self._control(apply)

    # ------------------------------------------------------------------ internals: control

    @staticmethod
    def _check_delay(delay_s: float) -> float:
        delay = float(delay_s)
        if not delay >= 0.0:  # also rejects NaN
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        return delay

    def _control(self, apply: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("proxy closed")
        thread = self._thread
        if thread is None or threading.current_thread() is thread:
            # Not running yet (start() honours the stored state) or called from the loop.
            apply()
            return
        if self._loop_error is not None or not thread.is_alive():
            raise RuntimeError(f"{self._name}: loop is not running") from self._loop_error
        cmd = Command(apply=apply, done=threading.Event())
        self._commands.put(cmd)
        self._wake()
        if not cmd.done.wait(self._control_timeout_s):
            raise TimeoutError(
                f"{self._name}: mode change not applied within {self._control_timeout_s}s"
            )
        if cmd.error is not None:
            raise cmd.error

    def _apply_mode(self, mode: ProxyMode, delay_s: float) -> None:
        with self._lock:
            old = self._mode
        if self._thread is None:  # before start(): only record it
            with self._lock:
                self._mode, self._delay_s = mode, delay_s
            return
        if mode is ProxyMode.REFUSE and old is not ProxyMode.REFUSE:
            self._unlisten()
        elif mode is not ProxyMode.REFUSE and old is ProxyMode.REFUSE:
            self._listen()  # may raise (port taken); the mode then stays refuse
        with self._lock:
            self._mode, self._delay_s = mode, delay_s
        if mode is ProxyMode.RESET:
            for conn in list(self._conns):
                self._abort(conn)

    def _wake(self) -> None:
        w = self._wake_w
        if w is None:
            return
        with contextlib.suppress(OSError):  # full buffer: a wake-up is already pending
            w.send(b"\0")
