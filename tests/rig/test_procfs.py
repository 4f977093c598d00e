"""``signal_landed``: a fault is applied only once the kernel shows it, so a scenario's
next step meets a peer that is really stopped, running again, or gone."""

from __future__ import annotations

import signal
import subprocess
import sys

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
