"""The loop thread of :class:`~kvfail.faults.proxy.FaultProxy`: the listener, the
``selectors`` loop over every proxied connection, and what each mode does to traffic.

Apart from :mod:`kvfail.faults.proxy` because moving bytes is a different job from
controlling the proxy: everything here runs on the loop thread (binding also before it
starts), and the control side reaches it through commands (:class:`Command`) that the loop
applies between passes.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfail.faults.proxy_conn import Conn, ConnState, Side, rst_close, tune
from kvfail.rig.loopback import LOOPBACK
from kvfail.rig.loopback import family as _family

log = logging.getLogger("kvfail.faults.proxy")

_CHUNK = 64 * 1024
# Stop reading a side once this much is queued for the other side: a delayed or stalled
# direction must not turn the proxy into an unbounded buffer.
_HIGH_WATER = 1 << 20
# Upper bound on one select(): the loop re-checks deadlines and the stop flag at least this
# often even if a wake-up byte were lost.
_MAX_SELECT_S = 0.25
_BACKLOG = 128


class ProxyMode(enum.StrEnum):
    """What the proxy does to traffic; see :mod:`kvfail.faults.proxy` for the faults they model."""

    PASS = "pass"
    RESET = "reset"
    BLACKHOLE = "blackhole"
    DELAY = "delay"
    REFUSE = "refuse"


@dataclass(slots=True)
class Command:
    apply: Callable[[], None]
    done: threading.Event
    error: BaseException | None = None


class ProxyLoop:
    """The loop-thread half of :class:`~kvfail.faults.proxy.FaultProxy`, which sets up
    every attribute below and runs :meth:`_run` on its thread."""

    _name: str
    _connect_timeout_s: float
    _lock: threading.Lock
    _mode: ProxyMode
    _delay_s: float
    _upstream: tuple[str, int]
    _accepted: int
    _bytes_up: int
    _bytes_down: int
    _aborted: int
    _upstream_failures: int
    _lsock: socket.socket | None
    _listening: bool
    _sel: selectors.BaseSelector | None
    _wake_r: socket.socket | None
    _conns: set[Conn]
    _masks: dict[socket.socket, int]
    _commands: queue.SimpleQueue[Command]
    _stopping: threading.Event
    _loop_error: BaseException | None
    port: int

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
                rst_close(client)
                continue
            tune(client)
            conn = Conn(client)
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
            if conn.state is ConnState.IDLE and forwarding:
                self._start_upstream(conn, now)
            if conn.closed:
                continue
            if conn.state is ConnState.CONNECTING:
                if now >= conn.connect_deadline:
                    log.info("%s: upstream connect timed out", self._name)
                    with self._lock:
                        self._upstream_failures += 1
                    self._abort(conn)
                    continue
                timeout = min(timeout, conn.connect_deadline - now)
            if forwarding and conn.state is ConnState.OPEN:
                self._forward_fins(conn)
                if conn.closed:
                    continue
                for leg in (conn.up, conn.down):
                    due = leg.head_due()
                    if due is not None and due > now:
                        timeout = min(timeout, due - now)
            self._set_interest(conn, forwarding, now)
        return max(timeout, 0.0)

    def _set_interest(self, conn: Conn, forwarding: bool, now: float) -> None:
        cmask = umask = 0
        if conn.state is ConnState.CONNECTING:
            umask |= selectors.EVENT_WRITE  # connect completion, even while blackholed
        elif forwarding and conn.state is ConnState.OPEN:
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
        self._set_mask(conn.client, cmask, (conn, Side.CLIENT))
        if conn.upstream is not None:
            self._set_mask(conn.upstream, umask, (conn, Side.UPSTREAM))

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

    def _start_upstream(self, conn: Conn, now: float) -> None:
        with self._lock:
            target = self._upstream
        up = socket.socket(_family(target[0]), socket.SOCK_STREAM)
        tune(up)
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
        conn.state = ConnState.CONNECTING
        conn.connect_deadline = now + self._connect_timeout_s

    def _finish_connect(self, conn: Conn) -> None:
        assert conn.upstream is not None
        err = conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            log.info("%s: upstream connect failed: %s", self._name, errno.errorcode.get(err, err))
            with self._lock:
                self._upstream_failures += 1
            # D sees its connection RST, as if P had refused it directly.
            self._abort(conn)
            return
        conn.state = ConnState.OPEN

    def _on_readable(self, conn: Conn, side: Side, now: float) -> None:
        if side is Side.CLIENT:
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

    def _on_writable(self, conn: Conn, side: Side, now: float) -> None:
        if side is Side.UPSTREAM and conn.state is ConnState.CONNECTING:
            self._finish_connect(conn)
            return
        if side is Side.CLIENT:
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
                if side is Side.CLIENT:
                    self._bytes_down += sent
                else:
                    self._bytes_up += sent

    def _forward_fins(self, conn: Conn) -> None:
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

    def _abort(self, conn: Conn) -> None:
        if conn.closed:
            return
        with self._lock:
            self._aborted += 1
        self._drop(conn, rst=True)

    def _drop(self, conn: Conn, *, rst: bool) -> None:
        conn.closed = True
        self._conns.discard(conn)
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            self._forget(sock)
            if rst:
                rst_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()
        conn.up.queue.clear()
        conn.down.queue.clear()
