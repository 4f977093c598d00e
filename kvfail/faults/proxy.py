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
RST" without sleeping. Every wait in this module is bounded.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvfail.rig.closing import ClosesOnExit
from kvfail.rig.loopback import LOOPBACK, require_local
from kvfail.rig.loopback import family as _family

__all__ = ["FaultProxy", "ProxyMode", "ProxyStats"]

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
# Stop reading a side once this much is queued for the other side: a delayed or stalled
# direction must not turn the proxy into an unbounded buffer.
_HIGH_WATER = 1 << 20
# Upper bound on one select(): the loop re-checks deadlines and the stop flag at least this
# often even if a wake-up byte were lost.
_MAX_SELECT_S = 0.25
_BACKLOG = 128
# SO_LINGER with a zero timeout makes close() send RST instead of FIN.
_LINGER_RST = struct.pack("ii", 1, 0)


class ProxyMode(enum.StrEnum):
    """What the proxy does to traffic; see the module docstring for the faults they model."""

    PASS = "pass"
    RESET = "reset"
    BLACKHOLE = "blackhole"
    DELAY = "delay"
    REFUSE = "refuse"


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


class _ConnState(enum.Enum):
    IDLE = enum.auto()  # no upstream yet (accepted while blackholed)
    CONNECTING = enum.auto()
    OPEN = enum.auto()


class _Side(enum.Enum):
    CLIENT = enum.auto()
    UPSTREAM = enum.auto()


class _Leg:
    """One direction of a proxied connection: chunks waiting for their due time."""

    __slots__ = ("eof", "last_due", "queue", "queued", "shut")

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.eof = False  # the source side sent FIN
        self.shut = False  # FIN forwarded to the destination side
        self.last_due = 0.0  # keeps chunks in order when the delay shrinks mid-stream

    def head_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


class _Conn:
    __slots__ = ("client", "closed", "connect_deadline", "down", "state", "up", "upstream")

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.state = _ConnState.IDLE
        self.connect_deadline = 0.0
        self.up = _Leg()  # client -> upstream
        self.down = _Leg()  # upstream -> client
        self.closed = False


@dataclass(slots=True)
class _Command:
    apply: Callable[[], None]
    done: threading.Event
    error: BaseException | None = None


def _rst_close(sock: socket.socket) -> None:
    """Close with RST: the peer sees ECONNRESET, not a clean EOF, as on a real reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    with contextlib.suppress(OSError):
        sock.close()


def _tune(sock: socket.socket) -> None:
    # Without NODELAY, Nagle plus delayed ACKs adds ~40 ms to small request/response
    # exchanges, which would blur the latency the delay mode is meant to add precisely.
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FaultProxy(ClosesOnExit):
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
        self._conns: set[_Conn] = set()
        self._masks: dict[socket.socket, int] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
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
        cmd = _Command(apply=apply, done=threading.Event())
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

    # ------------------------------------------------------------------ internals: listener

    def _bind(self, port: int) -> socket.socket:
        # SO_REUSEADDR lets refuse -> pass re-bind the port while accepted connections
        # (or their TIME_WAIT remains) still use it.
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((LOOPBACK, port))
        except BaseException:
            s.close()
            raise
        return s

    def _listen(self) -> None:
        if self._listening:
            return
        if self._lsock is None:
            self._lsock = self._bind(self.port)
        self._lsock.listen(_BACKLOG)
        self._lsock.setblocking(False)
        assert self._sel is not None
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._listening = True

    def _unlisten(self) -> None:
        """Close the listener, then keep the port reserved with a bound, non-listening socket.

        Linux cannot take a socket out of the listening state, so the listener is closed
        (queued, unaccepted connects get RST) and a fresh socket is bound to the same port:
        with no listener there, connects are refused, and no other process can grab it.
        """
        lsock = self._lsock
        self._lsock = None
        if lsock is not None:
            if self._listening and self._sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(lsock)
            lsock.close()
        self._listening = False
        try:
            self._lsock = self._bind(self.port)
        except OSError as exc:  # not fatal: _listen() binds again later
            log.warning("%s: could not keep port %d reserved: %s", self._name, self.port, exc)

    def _accept_all(self) -> None:
        assert self._lsock is not None
        while True:
            try:
                client, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: drop this round, the loop retries
                log.warning("%s: accept failed: %s", self._name, exc)
                return
            with self._lock:
                self._accepted += 1
                mode = self._mode
            if mode is ProxyMode.RESET:
                with self._lock:
                    self._aborted += 1
                _rst_close(client)
                continue
            _tune(client)
            conn = _Conn(client)
            self._conns.add(conn)  # the refresh pass connects upstream unless blackholed

    # ------------------------------------------------------------------ internals: loop

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                now = time.monotonic()
                timeout = self._refresh_all(now)
                assert self._sel is not None
                for key, mask in self._sel.select(timeout):
                    self._dispatch(key, mask)
        except BaseException as exc:  # keep the failure for callers; never die silently
            log.exception("%s: loop crashed", self._name)
            self._loop_error = exc
        finally:
            self._teardown()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                cmd.apply()
            except Exception as exc:
                cmd.error = exc
            finally:
                cmd.done.set()

    def _teardown(self) -> None:
        for conn in list(self._conns):
            self._abort(conn)
        if self._lsock is not None:
            with contextlib.suppress(OSError):
                self._lsock.close()
            self._lsock = None
        self._listening = False
        if self._sel is not None:
            with contextlib.suppress(OSError):
                self._sel.close()
        # Anyone still waiting on a command must not wait for its full timeout.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            cmd.error = RuntimeError(f"{self._name}: proxy closed")
            cmd.done.set()

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data is None:
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            elif self._listening and key.fileobj is self._lsock:
                self._accept_all()
            return
        conn, side = key.data
        if conn.closed:
            return
        now = time.monotonic()
        if mask & selectors.EVENT_WRITE:
            self._on_writable(conn, side, now)
        if mask & selectors.EVENT_READ and not conn.closed:
            self._on_readable(conn, side, now)

    def _refresh_all(self, now: float) -> float:
        """Advance every connection's state, set its selector interest, return the timeout."""
        timeout = _MAX_SELECT_S
        with self._lock:
            mode = self._mode
        forwarding = mode is not ProxyMode.BLACKHOLE
        for conn in list(self._conns):
            if conn.state is _ConnState.IDLE and forwarding:
                self._start_upstream(conn, now)
            if conn.closed:
                continue
            if conn.state is _ConnState.CONNECTING:
                if now >= conn.connect_deadline:
                    log.info("%s: upstream connect timed out", self._name)
                    with self._lock:
                        self._upstream_failures += 1
                    self._abort(conn)
                    continue
                timeout = min(timeout, conn.connect_deadline - now)
            if forwarding and conn.state is _ConnState.OPEN:
                self._forward_fins(conn)
                if conn.closed:
                    continue
                for leg in (conn.up, conn.down):
                    due = leg.head_due()
                    if due is not None and due > now:
                        timeout = min(timeout, due - now)
            self._set_interest(conn, forwarding, now)
        return max(timeout, 0.0)

    def _set_interest(self, conn: _Conn, forwarding: bool, now: float) -> None:
        cmask = umask = 0
        if conn.state is _ConnState.CONNECTING:
            umask |= selectors.EVENT_WRITE  # connect completion, even while blackholed
        elif forwarding and conn.state is _ConnState.OPEN:
            if not conn.up.eof and conn.up.queued < _HIGH_WATER:
                cmask |= selectors.EVENT_READ
            if not conn.down.eof and conn.down.queued < _HIGH_WATER:
                umask |= selectors.EVENT_READ
            due = conn.up.head_due()
            if due is not None and due <= now:
                umask |= selectors.EVENT_WRITE
            due = conn.down.head_due()
            if due is not None and due <= now:
                cmask |= selectors.EVENT_WRITE
        self._set_mask(conn.client, cmask, (conn, _Side.CLIENT))
        if conn.upstream is not None:
            self._set_mask(conn.upstream, umask, (conn, _Side.UPSTREAM))

    def _set_mask(self, sock: socket.socket, mask: int, data: object) -> None:
        assert self._sel is not None
        old = self._masks.get(sock, 0)
        if mask == old:
            return
        if old == 0:
            self._sel.register(sock, mask, data)
        elif mask == 0:
            self._sel.unregister(sock)
        else:
            self._sel.modify(sock, mask, data)
        if mask:
            self._masks[sock] = mask
        else:
            self._masks.pop(sock, None)

    def _forget(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        if self._masks.pop(sock, 0) and self._sel is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)

    def _start_upstream(self, conn: _Conn, now: float) -> None:
        with self._lock:
            target = self._upstream
        up = socket.socket(_family(target[0]), socket.SOCK_STREAM)
        _tune(up)
        err = up.connect_ex(target)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            up.close()
            reason = errno.errorcode.get(err, err)
            log.info("%s: upstream %s connect failed: %s", self._name, target, reason)
            with self._lock:
                self._upstream_failures += 1
            self._abort(conn)
            return
        conn.upstream = up
        conn.state = _ConnState.CONNECTING
        conn.connect_deadline = now + self._connect_timeout_s

    def _finish_connect(self, conn: _Conn) -> None:
        assert conn.upstream is not None
        err = conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            log.info("%s: upstream connect failed: %s", self._name, errno.errorcode.get(err, err))
            with self._lock:
                self._upstream_failures += 1
            # D sees its connection RST, as if P had refused it directly.
            self._abort(conn)
            return
        conn.state = _ConnState.OPEN

    def _on_readable(self, conn: _Conn, side: _Side, now: float) -> None:
        if side is _Side.CLIENT:
            src, leg = conn.client, conn.up
        else:
            assert conn.upstream is not None
            src, leg = conn.upstream, conn.down
        try:
            data = src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(conn)  # a reset on one side becomes a reset on the other
            return
        if not data:
            leg.eof = True
            return
        with self._lock:
            extra = self._delay_s if self._mode is ProxyMode.DELAY else 0.0
        due = max(now + extra, leg.last_due)
        leg.last_due = due
        leg.queue.append((due, data))
        leg.queued += len(data)

    def _on_writable(self, conn: _Conn, side: _Side, now: float) -> None:
        if side is _Side.UPSTREAM and conn.state is _ConnState.CONNECTING:
            self._finish_connect(conn)
            return
        if side is _Side.CLIENT:
            dst, leg = conn.client, conn.down
        else:
            assert conn.upstream is not None
            dst, leg = conn.upstream, conn.up
        sent = 0
        try:
            while leg.queue and leg.queue[0][0] <= now:
                due, data = leg.queue[0]
                n = dst.send(data)
                sent += n
                leg.queued -= n
                if n < len(data):
                    leg.queue[0] = (due, data[n:])
                    break
                leg.queue.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._abort(conn)
        if sent:
            with self._lock:
                if side is _Side.CLIENT:
                    self._bytes_down += sent
                else:
                    self._bytes_up += sent

    def _forward_fins(self, conn: _Conn) -> None:
        """Pass a half-close on once its data is out; close the pair when both ways are done."""
        assert conn.upstream is not None
        for leg, dst in ((conn.up, conn.upstream), (conn.down, conn.client)):
            if leg.eof and not leg.queue and not leg.shut:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    self._abort(conn)
                    return
                leg.shut = True
        if conn.up.shut and conn.down.shut:
            self._drop(conn, rst=False)

    def _abort(self, conn: _Conn) -> None:
        if conn.closed:
            return
        with self._lock:
            self._aborted += 1
        self._drop(conn, rst=True)

    def _drop(self, conn: _Conn, *, rst: bool) -> None:
        conn.closed = True
        self._conns.discard(conn)
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            self._forget(sock)
            if rst:
                _rst_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()
        conn.up.queue.clear()
        conn.down.queue.clear()
