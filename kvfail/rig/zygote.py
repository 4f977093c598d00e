"""A standby interpreter that has imported the heavy modules once and forks peers from it.

Why: every P process imports vLLM and torch before it can serve, tens of seconds of CPU
on a small machine, and the suite starts a new P after every scenario that kills one. A
zygote pays the import once; each peer is then a ``fork`` of it, which runs its
``python -m`` module as ``__main__``, exactly as a fresh interpreter would.

A forked peer is still a real process in a session of its own: it is killed, frozen and
cut off like any other (:class:`~kvfail.rig.processes.PeerProcess` signals its group), and its
stdin/stdout/stderr are pipes the caller created and passed over the control socket. Only
the parentage differs: the zygote reaps the peer and reports its exit status, so the
caller sees it through :class:`ZygoteChild`, which answers the part of
:class:`subprocess.Popen` that :class:`~kvfail.rig.processes.PeerProcess` uses.

The zygote is single-threaded (``select`` on its control socket and a SIGCHLD wakeup
pipe), so a fork never copies a lock another thread held. Run as ``python -m
kvfail.rig.zygote --fd N --preload a,b``; :class:`Zygote` starts it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["Zygote", "ZygoteChild", "ZygoteError", "close_zygotes", "shared_zygote"]

log = logging.getLogger("kvfail.rig.zygote")

#: The largest control message (a request carries the child's whole environment).
_MAX_MSG = 1 << 20
#: Standard streams handed to a child, in order: stdin, stdout, stderr.
_STDIO = 3


class ZygoteError(RuntimeError):
    """The zygote could not start, or died, or refused a request."""


# --------------------------------------------------------------------------- server side


def _send(sock: socket.socket, obj: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _reap(sock: socket.socket) -> None:
    """Report every child that has exited (``rc`` as :mod:`subprocess` reports it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            _send(sock, {"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def _run_child(
    req: Mapping[str, Any], fds: list[int], sock: socket.socket, closing: Sequence[int]
) -> None:
    """In the forked child: become the requested ``python -m`` process; never returns."""
    code: int = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in closing:
            os.close(fd)
        os.setpgid(0, 0)  # its own group in our session, as PeerProcess gives it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cwd"):
            os.chdir(req["cwd"])
        for hook in req.get("before", ()):
            module, _, func = str(hook).partition(":")
            getattr(importlib.import_module(module), func)()
        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(fd: int, preload: Sequence[str]) -> None:
    """The zygote's loop: import ``preload``, then fork one child per request until the
    control socket closes (the caller went away; the children live on, each in its own
    session, for the caller's own clean-up to kill)."""
    sock = socket.socket(fileno=fd)
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # imported objects stay out of the children's collections: fewer COW pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sys.stdout.flush()
    sys.stderr.flush()
    _send(sock, {"ready": os.getpid(), "preloaded": list(preload)})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
            _reap(sock)
        if sock not in readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, _STDIO)
        if not msg:
            return
        req = json.loads(msg)
        if len(fds) != _STDIO:
            for received in fds:
                os.close(received)
            _send(sock, {"token": req.get("token"), "error": f"expected {_STDIO} fds"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(req, fds, sock, (wake_r, wake_w))
        for received in fds:
            os.close(received)
        _send(sock, {"token": req.get("token"), "pid": pid})


# --------------------------------------------------------------------------- client side


class ZygoteChild:
    """A forked peer, seen through the part of :class:`subprocess.Popen` that
    :class:`~kvfail.rig.processes.PeerProcess` uses (``pid``, ``poll``, ``wait``, ``kill`` and the
    three pipes). Its exit status comes from the zygote, which is its parent."""

    def __init__(
        self,
        zygote: Zygote,
        pid: int,
        stdin: IO[bytes] | None,
        stdout: IO[bytes],
        stderr: IO[bytes] | None,
    ) -> None:
        self._zygote = zygote
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.args = [f"zygote:{pid}"]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self._zygote.exit_status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._zygote.wait_exit(self.pid, timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The caller's handle on one zygote process (see the module docstring).

    ``env`` is the environment the zygote imports under: only what a module reads at
    import time matters there (each child gets its own full environment at the fork).
    """

    def __init__(
        self,
        preload: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 240.0,
    ) -> None:
        self.preload = tuple(preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()  # one request on the socket at a time
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._dead = False
        self._token = 0
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self._popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from {__name__} import main; main()",
                "--fd",
                str(theirs.fileno()),
                "--preload",
                ",".join(self.preload),
            ],
            stdin=subprocess.DEVNULL,
            # Its own output (import warnings, a failed preload's traceback) is kept for
            # the error message, never left on whichever test's capture was active.
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            pass_fds=[theirs.fileno()],
            process_group=0,  # own group, our session (see kvfail.rig.processes)
        )
        theirs.close()
        self.pid = self._popen.pid
        self._output: deque[str] = deque(maxlen=40)
        self._threads = [
            threading.Thread(target=self._read, name=f"zygote-{self.pid}", daemon=True),
            threading.Thread(target=self._drain, name=f"zygote-out-{self.pid}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        ready = self._wait_reply(-1, ready_timeout_s)
        if ready is None:
            self.close()
            raise ZygoteError(
                f"zygote (pid {self.pid}) not ready after {ready_timeout_s}s "
                f"importing {list(self.preload)}; its output:\n" + "\n".join(self._output)
            )

    # ------------------------------------------------------------------ messages

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(_MAX_MSG)
            except OSError:
                msg = b""
            with self._cond:
                if not msg:
                    self._dead = True
                    self._cond.notify_all()
                    return
                reply = json.loads(msg)
                if "exited" in reply:
                    self._exits[int(reply["exited"])] = int(reply["rc"])
                elif "ready" in reply:
                    self._replies[-1] = reply
                else:
                    self._replies[int(reply["token"])] = reply
                self._cond.notify_all()

    def _drain(self) -> None:
        assert self._popen.stdout is not None
        for raw in self._popen.stdout:
            self._output.append(raw.decode(errors="replace").rstrip())

    def _wait_reply(self, token: int, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while token not in self._replies:
                remaining = deadline - time.monotonic()
                if self._dead or remaining <= 0:
                    return None
                self._cond.wait(min(remaining, 0.5))
            return self._replies.pop(token)

    @property
    def alive(self) -> bool:
        return not self._dead and self._popen.poll() is None

    # ------------------------------------------------------------------ children

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
        stdin: bool = False,
        merge_stderr: bool = False,
        before: Sequence[str] = (),
        timeout_s: float = 30.0,
    ) -> ZygoteChild:
        """Fork ``argv`` (``[python, "-m", module, *args]``) from the zygote.

        ``before`` names ``module:function`` hooks the child runs, in order, after it
        took its environment and before the module (e.g. work that must happen while the
        child still has one thread)."""
        module, args = _module_argv(argv)
        in_r, in_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe()
        err_r, err_w = (out_r, out_w) if merge_stderr else os.pipe()
        theirs = [in_r, out_w, out_w if merge_stderr else err_w]
        with self._lock:
            self._token += 1
            token = self._token
            req = {
                "token": token,
                "module": module,
                "args": list(args),
                "env": dict(env),
                "cwd": cwd,
                "before": list(before),
            }
            try:
                _send(self._sock, req, theirs)
            except OSError as exc:
                self._dead = True
                raise ZygoteError(f"zygote (pid {self.pid}) is gone: {exc}") from exc
            finally:
                for fd in set(theirs):
                    os.close(fd)
        reply = self._wait_reply(token, timeout_s)
        if reply is None or "pid" not in reply:
            for fd in {out_r, err_r, in_w} - {-1}:
                os.close(fd)
            why = "no answer" if reply is None else reply.get("error")
            raise ZygoteError(f"zygote (pid {self.pid}) did not fork {module}: {why}")
        return ZygoteChild(
            self,
            int(reply["pid"]),
            os.fdopen(in_w, "wb") if stdin else None,
            os.fdopen(out_r, "rb"),
            None if merge_stderr else os.fdopen(err_r, "rb"),
        )

    def exit_status(self, pid: int) -> int | None:
        """``pid``'s return code once the zygote reaped it; None while it runs.

        A zygote that died can no longer reap: its orphaned child then counts as exited
        once the kernel no longer knows it (or knows it only as a zombie)."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            dead = self._dead
        if dead and not _pid_running(pid):
            return -signal.SIGKILL
        return None

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            rc = self.exit_status(pid)
            if rc is not None:
                return rc
            with self._cond:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(0.05 if remaining is None else min(remaining, 0.05))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the zygote (its running children are the callers' to close)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self._popen.wait(timeout_s)
        self._sock.close()
        for thread in self._threads:
            thread.join(1.0)
        if self._popen.stdout is not None:
            self._popen.stdout.close()


def _module_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    argv = [os.fspath(a) for a in argv]
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"a zygote runs `python -m module ...` only, not {argv}")
    return argv[2], argv[3:]


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


# --------------------------------------------------------------------------- registry

_shared: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], Zygote] = {}
_shared_lock = threading.Lock()


def shared_zygote(preload: Sequence[str], import_env: Mapping[str, str]) -> Zygote:
    """The process-wide zygote for ``preload`` under ``import_env`` (started on first
    use, replaced if it died); :func:`close_zygotes` stops them all at exit."""
    key = (tuple(preload), tuple(sorted(import_env.items())))
    with _shared_lock:
        zygote = _shared.get(key)
        if zygote is None or not zygote.alive:
            zygote = Zygote(preload, env=import_env)
            _shared[key] = zygote
        return zygote


def close_zygotes() -> None:
    with _shared_lock:
        zygotes = list(_shared.values())
        _shared.clear()
    for zygote in zygotes:
        with contextlib.suppress(Exception):
            zygote.close()


atexit.register(close_zygotes)


def main() -> None:
    """The zygote process's entry point (``--fd`` its control socket)."""
    parser = argparse.ArgumentParser(description="kvfail zygote (see module docstring)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--preload", default="")
    args = parser.parse_args()
    serve(args.fd, [m for m in args.preload.split(",") if m])
    # Nothing here needs finalising (the children are on their own), and tearing down an
    # interpreter that imported vLLM and torch takes seconds the caller's exit waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
