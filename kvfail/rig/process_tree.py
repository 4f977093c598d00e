"""Stopping a child process and every process under it, whatever their groups.

Why: a child pytest (the audit's dynamic tier) starts peers in process groups of their
own, so killing the child's group alone would orphan them; and a peer the child forgot to
close must not outlive the run. Processes are tracked as pid -> start time
(:func:`kvfail.rig.procfs.descendants`), so a recycled pid is never killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from kvfail.rig.procfs import cmdline, descendants, proc_state, same_process_alive

__all__ = ["kill_tracked", "reap", "stop_tree"]


def stop_tree(
    proc: subprocess.Popen[bytes], tracked: dict[int, str], grace_s: float
) -> dict[int, str]:
    """SIGTERM ``proc`` (a child pytest: its teardown closes its peers), then after
    ``grace_s`` SIGKILL its process group and every descendant seen. ``proc`` must have
    been started with ``process_group=0``. Returns the descendants seen along the way
    (pid -> start time, for :func:`reap`), ``tracked`` included.

    The child is not reaped before its group is killed (a zombie keeps its pid, so the
    pid cannot have been recycled); its descendants are re-parented when it exits, which
    is why a caller tracks them (:func:`~kvfail.rig.procfs.descendants`) while it runs."""
    seen = dict(tracked)
    if proc.returncode is None:
        seen.update(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and proc_state(proc.pid) not in (None, "Z"):
            seen.update(descendants(proc.pid))
            time.sleep(0.2)
        seen.update(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid (process_group=0)
    kill_tracked(seen)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return seen


def kill_tracked(procs: dict[int, str]) -> list[str]:
    """SIGKILL each process of ``procs`` (pid -> start time) that still runs (its group
    when it leads one); returns their command lines."""
    killed: list[tuple[int, str, str]] = []
    for pid, start in procs.items():
        if not same_process_alive(pid, start):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:  # a peer's own group (its TP ranks, forkserver)
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append((pid, start, cmdline(pid) or str(pid)))
    deadline = time.monotonic() + 5.0  # SIGKILL lands when the process is next scheduled
    while time.monotonic() < deadline and any(same_process_alive(p, s) for p, s, _c in killed):
        time.sleep(0.05)
    return [cmd for _p, _s, cmd in killed]


def reap(tracked: dict[int, str], grace_s: float = 3.0) -> list[str]:
    """Kill what a finished child left behind (a peer it failed to close) after a short
    grace; returns what had to be killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(same_process_alive(p, s) for p, s in tracked.items()):
        time.sleep(0.1)
    return kill_tracked(tracked)
