"""``signal_landed``: a fault is applied only once the kernel shows it, so a scenario's
next step meets a peer that is really stopped, running again, or gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from kvfail.rig.procfs import proc_state, signal_landed


def test_each_signal_returns_once_its_effect_shows() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        signal_landed(child.pid, signal.SIGSTOP)
        assert proc_state(child.pid) in ("T", "t")
        child.send_signal(signal.SIGCONT)
        signal_landed(child.pid, signal.SIGCONT)
        assert proc_state(child.pid) not in ("T", "t")
        child.send_signal(signal.SIGKILL)
        signal_landed(child.pid, signal.SIGKILL)
        # Not reaped yet (this test is its parent): a zombie, whose sockets are closed.
        assert proc_state(child.pid) in ("Z", "X", None)
    finally:
        child.kill()
        child.wait(timeout=10)


#: A process whose leader thread exits (``pthread_exit``) while another thread keeps its
#: listening socket: the leader shows ``Z``, the socket still accepts.
_LEADER_GONE_THREAD_LIVES = """
import ctypes, socket, threading, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
threading.Thread(target=time.sleep, args=(60,)).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_zombie_leader_with_a_live_thread_has_not_landed_a_kill() -> None:
    """The state a SIGKILL passes through in a process with many threads: the leader has
    exited (``Z``) while another thread still holds the process's files, so its
    listener still completes connects. A kill has landed only once no thread is left."""
    import socket

    child = subprocess.Popen(
        [sys.executable, "-c", _LEADER_GONE_THREAD_LIVES], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while proc_state(child.pid) != "Z":  # the leader has exited; its thread has not
            assert time.monotonic() < deadline, proc_state(child.pid)
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # the listener still accepts
        try:
            signal_landed(child.pid, signal.SIGKILL, timeout_s=0.5)
        except TimeoutError:
            pass
        else:
            raise AssertionError("a kill counted as landed while a thread holds the sockets")
        child.send_signal(signal.SIGKILL)
        signal_landed(child.pid, signal.SIGKILL)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        except ConnectionRefusedError:
            pass
        else:
            raise AssertionError("the killed process's listener still accepts")
    finally:
        child.kill()
        child.wait(timeout=10)
