"""Real peer processes that a test can kill, freeze and thaw, and that never outlive pytest.

Process faults are the only honest way to produce a crashed or hung peer: the kernel closes
a killed process's sockets (the RST/EOF a transport sees), and a SIGSTOPped process keeps
them open while answering nothing (the silent peer NIXL never detects). Each peer runs in
its own process group, so a fault or a cleanup reaches the workers it spawned too (vLLM's
engine core holds the listening sockets, not the API process).

Leaks are the main hazard: a stopped process ignores SIGTERM until continued, and a test
that fails half-way skips its own cleanup. `PeerProcess.close` therefore always continues,
terminates, then kills the whole group, and a module registry plus an `atexit` hook close
whatever a test forgot. Every wait is bounded. What the kernel shows of a peer is read in
:mod:`kvfail.rig.procfs`; its ports come from :mod:`kvfail.rig.ports`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from kvfail.rig.closing import ClosesOnExit
from kvfail.rig.procfs import group_members, proc_state

if TYPE_CHECKING:
    from kvfail.rig.zygote import Zygote, ZygoteChild

__all__ = [
    "PeerExitedError",
    "PeerProcess",
    "close_all",
    "close_peers_on_sigterm",
    "live_peers",
]

log = logging.getLogger(__name__)

Stream = Literal["stdout", "stderr", "both"]
LineMatcher = str | re.Pattern[str]

_POLL_S = 0.02
#: How long an exited process's pipe readers get to finish before its error is written.
EXIT_DRAIN_S = 1.0

# Every rig process gets a process group of its own (killpg reaches it and its children,
# never us) but stays in our session. Under the kernel's autogroup scheduling each
# session is a scheduling group of its own, and on a busy machine a P alone in its session
# sat runnable without CPU for long stretches, stalling the scenarios that waited on it
# (docs/testing.md, "Rig processes stay in the test's session").


class PeerExitedError(RuntimeError):
    """The peer died while we waited for it: fail at once instead of running to the timeout."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


class _LineBuffer:
    """Lines read from one pipe by a background thread, kept bounded for long-lived peers."""

    def __init__(self, maxlen: int, cond: threading.Condition) -> None:
        self.lines: deque[str] = deque(maxlen=maxlen)
        self.total = 0  # lines ever appended, to find the new ones after the deque wrapped
        self.eof = False
        self._cond = cond

    def pump(self, pipe: IO[bytes]) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._cond:
                    self.lines.append(line)
                    self.total += 1
                    self._cond.notify_all()
        except (OSError, ValueError):  # pipe closed under us during close()
            pass
        finally:
            with self._cond:
                self.eof = True
                self._cond.notify_all()

    def since(self, seen: int) -> list[str]:
        """Lines appended after the first `seen` (caller holds the condition)."""
        n = len(self.lines)
        new = min(self.total - seen, n)
        # Index from the right end (cheap on a deque) rather than copying all of it.
        return [self.lines[i] for i in range(n - new, n)] if new > 0 else []


class PeerProcess(ClosesOnExit):
    """A child process in its own session, with fault controls and guaranteed cleanup.

    Signals go to the whole process group by default (``group=True``): a peer's workers
    must crash or hang with it, or the fault does not happen.
    """

    def __init__(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
        cwd: str | os.PathLike[str] | None = None,
        stdin: bool = False,
        merge_stderr: bool = False,
        max_lines: int = 10_000,
        zygote: Zygote | None = None,
        before: Sequence[str] = (),
    ) -> None:
        """``zygote``: fork ``argv`` (``python -m module ...``) from that standby
        interpreter instead of starting a new one; ``before`` are its ``module:function``
        hooks (see :mod:`kvfail.rig.zygote`). Everything else is the same either way."""
        if isinstance(argv, str | bytes):
            raise TypeError("argv must be a list of arguments, not one string (no shell here)")
        self.argv = [os.fspath(a) for a in argv]
        self.name = name or Path(self.argv[0]).name
        full_env = dict(os.environ) if inherit_env else {}
        # Ready lines must not sit in a child's stdio buffer until it exits.
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self._cond = threading.Condition()
        self._out = _LineBuffer(max_lines, self._cond)
        self._err = _LineBuffer(max_lines, self._cond)
        self._closed = False
        self._popen: subprocess.Popen[bytes] | ZygoteChild
        if zygote is not None:
            self._popen = zygote.spawn(
                self.argv,
                env=full_env,
                cwd=None if cwd is None else os.fspath(cwd),
                stdin=stdin,
                merge_stderr=merge_stderr,
                before=before,
            )
        else:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                cwd=cwd,
                env=full_env,
                process_group=0,  # own group, pgid == pid; our session (see above)
                close_fds=True,
            )
        self.pid = self._popen.pid
        self.pgid = self.pid
        _register(self)
        self._readers: list[threading.Thread] = []
        pipes: list[tuple[_LineBuffer, IO[bytes] | None]] = [(self._out, self._popen.stdout)]
        if merge_stderr:
            self._err.eof = True
        else:
            pipes.append((self._err, self._popen.stderr))
        for buf, pipe in pipes:
            assert pipe is not None
            t = threading.Thread(
                target=buf.pump, args=(pipe,), name=f"peer-{self.name}-{self.pid}", daemon=True
            )
            t.start()
            self._readers.append(t)

    # ------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        """True until the process has exited (a frozen process is alive)."""
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Negative signal number if killed by a signal, as with subprocess."""
        return self._popen.poll()

    @property
    def state(self) -> str | None:
        """Kernel state letter of the leader; 'T' while frozen, None once reaped."""
        return proc_state(self.pid) if self.alive else None

    @property
    def frozen(self) -> bool:
        return self.state in ("T", "t")

    def group_members(self) -> list[int]:
        """Live processes of this peer's group (the leader and anything it spawned)."""
        return group_members(self.pgid)

    def stdout_lines(self) -> list[str]:
        with self._cond:
            return list(self._out.lines)

    def stderr_lines(self) -> list[str]:
        with self._cond:
            return list(self._err.lines)

    def output_marker(self) -> tuple[int, int]:
        """Lines produced so far on (stdout, stderr): where :meth:`output_since` starts."""
        with self._cond:
            return (self._out.total, self._err.total)

    def output_since(self, marker: tuple[int, int] = (0, 0), *, stdout: bool = True) -> list[str]:
        """Lines produced after ``marker`` (stdout's unless ``stdout=False``, then
        stderr's), as far as kept."""
        with self._cond:
            out = self._out.since(marker[0]) if stdout else []
            return out + self._err.since(marker[1])

    def output_tail(self, n: int = 40) -> str:
        """Recent output for assertion messages: why did the peer fail to come up?"""
        with self._cond:
            out = list(self._out.lines)[-n:]
            err = list(self._err.lines)[-n:]
        parts = [f"[{self.name} pid={self.pid} rc={self.returncode}]"]
        if out:
            parts.append("stdout:\n" + "\n".join(out))
        if err:
            parts.append("stderr:\n" + "\n".join(err))
        return "\n".join(parts)

    # ------------------------------------------------------------------ readiness

    def wait_ready(
        self,
        timeout_s: float,
        *,
        line: LineMatcher | None = None,
        predicate: Callable[[], bool] | None = None,
        path: str | os.PathLike[str] | None = None,
        stream: Stream = "stdout",
    ) -> str | None:
        """Block until the peer is ready; return the matching line (None for a predicate).

        Exactly one of `line` (a substring or compiled regex, searched in the peer's output,
        or in the file `path` when given) and `predicate` (polled) must be set. Raises
        PeerExitedError as soon as the peer dies and TimeoutError after `timeout_s`.
        """
        if (line is None) == (predicate is None):
            raise ValueError("give exactly one of line= or predicate=")
        if path is not None and line is None:
            raise ValueError("path= needs line=")
        deadline = time.monotonic() + timeout_s
        if predicate is not None:
            return self._wait_predicate(predicate, deadline, timeout_s)
        assert line is not None
        match = self._matcher(line)
        if path is not None:
            return self._wait_file(Path(path), match, deadline, timeout_s)
        return self._wait_stream(match, stream, deadline, timeout_s)

    @staticmethod
    def _matcher(line: LineMatcher) -> Callable[[str], bool]:
        if isinstance(line, re.Pattern):
            return lambda s: line.search(s) is not None
        return lambda s: line in s

    def _exited(self, what: str) -> PeerExitedError:
        # The process is gone, but its last words may still be in the pipes (an error on
        # stderr while the wait watched stdout): read them first, bounded, so the error
        # says why it died. Never called with the condition held (the readers take it).
        for t in self._readers:
            t.join(EXIT_DRAIN_S)
        return PeerExitedError(
            f"peer {self.name} exited (rc={self.returncode}) before {what}\n{self.output_tail()}",
            self.returncode,
        )

    def _timed_out(self, what: str, timeout_s: float) -> TimeoutError:
        return TimeoutError(
            f"peer {self.name} not ready ({what}) after {timeout_s}s\n{self.output_tail()}"
        )

    def _wait_predicate(
        self, predicate: Callable[[], bool], deadline: float, timeout_s: float
    ) -> None:
        while True:
            if predicate():
                return None
            if not self.alive:
                # One last look: the peer may have finished its work and exited.
                if predicate():
                    return None
                raise self._exited("predicate held")
            if time.monotonic() >= deadline:
                raise self._timed_out("predicate", timeout_s)
            time.sleep(_POLL_S)

    def _wait_file(
        self, path: Path, match: Callable[[str], bool], deadline: float, timeout_s: float
    ) -> str:
        def scan() -> str | None:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return None
            return next((ln for ln in text.splitlines() if match(ln)), None)

        while True:
            found = scan()
            if found is not None:
                return found
            if not self.alive:
                found = scan()
                if found is not None:
                    return found
                raise self._exited(f"a matching line in {path}")
            if time.monotonic() >= deadline:
                raise self._timed_out(f"line in {path}", timeout_s)
            time.sleep(_POLL_S)

    def _wait_stream(
        self, match: Callable[[str], bool], stream: Stream, deadline: float, timeout_s: float
    ) -> str:
        bufs = {"stdout": [self._out], "stderr": [self._err], "both": [self._out, self._err]}
        watched = bufs[stream]
        seen = [0] * len(watched)
        with self._cond:
            while True:
                for i, buf in enumerate(watched):
                    new = buf.since(seen[i])
                    seen[i] = buf.total
                    for candidate in new:
                        if match(candidate):
                            return candidate
                # Dead only counts once its pipes are drained: the ready line may be the
                # last thing it printed.
                if all(b.eof for b in watched) and not self.alive:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timed_out(f"line on {stream}", timeout_s)
                # Bounded even if no line ever comes: we also need to notice the exit.
                self._cond.wait(min(remaining, 0.1))
        raise self._exited(f"a matching line on {stream}")

    def wait(self, timeout_s: float) -> int:
        """Wait for the peer to exit by itself; TimeoutError if it does not."""
        try:
            return self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"peer {self.name} still running after {timeout_s}s") from None

    # ------------------------------------------------------------------ faults

    def send_signal(self, sig: int, *, group: bool = True) -> None:
        """Send `sig` to the group (or only the leader); a vanished target is not an error."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.pgid, sig)
            elif self.alive:
                os.kill(self.pid, sig)

    def kill(self, *, group: bool = True, timeout_s: float = 5.0) -> int:
        """SIGKILL (a crash), then reap: on return the kernel has closed the peer's sockets."""
        self.send_signal(signal.SIGKILL, group=group)
        rc = self.wait(timeout_s)
        if group:
            self._wait_group_gone(timeout_s)
        return rc

    def freeze(self, *, group: bool = True, timeout_s: float = 10.0) -> None:
        """SIGSTOP: a hung peer whose sockets stay open.

        Returns only once the kernel shows every targeted process stopped ('T'): signal
        delivery is asynchronous, and a worker still running for a few more milliseconds
        could answer the very request the test expects to go unanswered.
        """
        if not self.alive:
            raise self._exited("freeze")
        self.send_signal(signal.SIGSTOP, group=group)
        self._wait_stopped(True, group, timeout_s)

    def thaw(self, *, group: bool = True, timeout_s: float = 10.0) -> None:
        """SIGCONT; returns once no targeted process is still in the stopped state."""
        self.send_signal(signal.SIGCONT, group=group)
        self._wait_stopped(False, group, timeout_s)

    def _wait_stopped(self, stopped: bool, group: bool, timeout_s: float) -> None:
        """Wait for the kernel to show the new state; a member still pending is signalled
        again now and then: one forked after the group was signalled (a server's helper
        process) missed it, and resending SIGSTOP/SIGCONT is idempotent."""
        what = "stopped" if stopped else "continued"
        sig = signal.SIGSTOP if stopped else signal.SIGCONT
        deadline = time.monotonic() + timeout_s
        resend_at = time.monotonic() + 0.1
        while True:
            leader = proc_state(self.pid)
            if leader is None or leader in "ZXx":
                raise self._exited(what)
            pids = self.group_members() if group else [self.pid]
            states = {pid: proc_state(pid) for pid in pids}
            pending = {
                pid: st
                for pid, st in states.items()
                if st is not None and st not in "ZXx" and (st in "Tt") != stopped
            }
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"peer {self.name} not {what} after {timeout_s}s (states {pending})"
                )
            if now >= resend_at:
                resend_at = now + 0.1
                for pid in pending:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
            time.sleep(0.005)

    def _wait_group_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.group_members():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    # ------------------------------------------------------------------ stdin

    def write_stdin(self, data: str | bytes) -> None:
        """Send a command to a peer started with stdin=True (e.g. a line-based protocol)."""
        pipe = self._popen.stdin
        if pipe is None:
            raise RuntimeError("peer started without stdin=True")
        pipe.write(data.encode() if isinstance(data, str) else data)
        pipe.flush()

    # ------------------------------------------------------------------ cleanup

    def close(self, grace_s: float = 1.0, timeout_s: float = 5.0) -> int | None:
        """Always leave nothing behind: SIGCONT, SIGTERM, then SIGKILL, to the whole group.

        SIGCONT comes first because a stopped process only acts on SIGTERM once continued.
        Never raises for a stubborn process; logs instead, so teardown cannot mask a test's
        real failure. Returns the leader's return code (None if it could not be reaped).
        """
        if self._closed:
            return self.returncode
        self._closed = True
        try:
            if self.alive or self.group_members():
                self.send_signal(signal.SIGCONT)
                self.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._popen.wait(grace_s)
                if self.alive or self.group_members():
                    self.send_signal(signal.SIGKILL)
                    with contextlib.suppress(ProcessLookupError):
                        self._popen.kill()  # the leader, even if it left its group
                try:
                    self._popen.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.error(
                        "peer %s (pid %d) survived SIGKILL for %ss", self.name, self.pid, timeout_s
                    )
                if not self._wait_group_gone(timeout_s):
                    log.error(
                        "peer %s: group %d still has %s", self.name, self.pgid, self.group_members()
                    )
        finally:
            self._close_pipes()
            _unregister(self)
        return self.returncode

    def _close_pipes(self) -> None:
        if self._popen.stdin is not None:
            with contextlib.suppress(OSError):
                self._popen.stdin.close()
        # Readers hit EOF once every writer (the whole group) is dead; a process that escaped
        # the group could keep a pipe open, so the join is bounded and the threads are daemons.
        for t in self._readers:
            t.join(1.0)
        for pipe in (self._popen.stdout, self._popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __repr__(self) -> str:
        return f"PeerProcess(name={self.name!r}, pid={self.pid}, rc={self.returncode})"


# ---------------------------------------------------------------------- registry

_registry: dict[int, PeerProcess] = {}
_registry_lock = threading.Lock()


def _register(peer: PeerProcess) -> None:
    with _registry_lock:
        _registry[peer.pid] = peer


def _unregister(peer: PeerProcess) -> None:
    with _registry_lock:
        if _registry.get(peer.pid) is peer:
            del _registry[peer.pid]


def live_peers() -> list[PeerProcess]:
    """Peers started and not yet closed (a fixture can assert this is empty after a test)."""
    with _registry_lock:
        return list(_registry.values())


def close_all(grace_s: float = 0.5) -> None:
    """Close every peer not yet closed; also registered with atexit."""
    for peer in live_peers():
        try:
            peer.close(grace_s=grace_s)
        except Exception:  # one failure must not leave the others running
            log.exception("closing %r", peer)


atexit.register(close_all)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # pytest then tears its fixtures down, closing the peers


def close_peers_on_sigterm() -> bool:
    """Make SIGTERM unwind like Ctrl-C, so fixtures and ``atexit`` close the peers.

    Why: Python's default SIGTERM ends the process at once, skipping both, and every
    peer (its own process group, by design) is orphaned; ``timeout`` and CI runners stop
    a run with SIGTERM. Installed only over the default handler, from the main thread.
    Returns whether it was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _interrupted)
    return True
