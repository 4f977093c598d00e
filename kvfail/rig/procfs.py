"""What the kernel shows of a process in ``/proc``: its state, its group, its threads'
CPU use, its descendants.

Why one module: the rig reads ``/proc`` to know a fault has landed (a frozen peer is 'T'
in every member of its group), to know nothing is left behind (a group's members, a
child's descendants, whatever their session), and to say why a process does not answer
(which of its threads used the CPU). A ``stat`` line is parsed here only.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "busiest_processes",
    "busy_threads",
    "cmdline",
    "descendants",
    "group_members",
    "proc_state",
    "same_process_alive",
    "signal_landed",
    "spinning_threads",
    "thread_shares",
]


def _stat(path: str) -> tuple[str, list[str]] | None:
    """A /proc ``stat`` file: the command name, and the fields after it (index 0 = state,
    1 = ppid, 2 = pgrp, 11 = utime, 12 = stime, 19 = start time); None once the process is gone.

    The command name may contain spaces and parentheses, so split at the last ')'.
    """
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            raw = f.read()
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")
    return head.partition("(")[2], rest.split()


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state on (see :func:`_stat`)."""
    stat = _stat(f"/proc/{pid}/stat")
    return None if stat is None else stat[1]


def _thread_times(pid: int) -> dict[int, tuple[str, str, int]]:
    """Each thread of ``pid``: (name, state, CPU clock ticks so far)."""
    out: dict[int, tuple[str, str, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        stat = _stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:
            name, fields = stat
            out[int(tid)] = (name, fields[0], int(fields[11]) + int(fields[12]))
    return out


ThreadShare = tuple[str, str, float]


def thread_shares(pids: Sequence[int], window_s: float = 0.5) -> dict[int, dict[int, ThreadShare]]:
    """Each thread of each of ``pids`` over one common window of ``window_s``: (name,
    state, share of one core). A process that is gone maps to no threads."""
    before = {pid: _thread_times(pid) for pid in pids}
    time.sleep(window_s)
    ticks = os.sysconf("SC_CLK_TCK") * window_s
    return {
        pid: {
            tid: (name, state, min((cpu - before[pid].get(tid, ("", "", cpu))[2]) / ticks, 1.0))
            for tid, (name, state, cpu) in _thread_times(pid).items()
        }
        for pid in pids
    }


def busiest_processes(window_s: float = 0.5, most: int = 5) -> list[str]:
    """The processes on this machine that used the most CPU over one window of
    ``window_s`` (``pid name state share``, busiest first): evidence for a load that
    waited on a peer, when the question is whether anything was left to run it."""

    def times() -> dict[int, tuple[str, str, int]]:
        out: dict[int, tuple[str, str, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(f"/proc/{entry}/stat")
                if stat is not None:
                    name, fields = stat
                    out[int(entry)] = (name, fields[0], int(fields[11]) + int(fields[12]))
        return out

    before = times()
    time.sleep(window_s)
    ticks = os.sysconf("SC_CLK_TCK") * window_s
    used = [
        (cpu - before[pid][2], pid, name, state)
        for pid, (name, state, cpu) in times().items()
        if pid in before
    ]
    used.sort(reverse=True)
    return [f"{pid} {name} {state} {delta / ticks:.0%}" for delta, pid, name, state in used[:most]]


def busy_threads(pids: Sequence[int], window_s: float = 0.5, most: int = 3) -> dict[int, str]:
    """For each of ``pids``, the threads that used the most CPU over one common window of
    ``window_s`` (name, state, share of one core), main thread first: evidence for a
    process that does not answer. Empty for a process that is gone."""
    out: dict[int, str] = {}
    for pid, used in thread_shares(pids, window_s).items():
        main = used.pop(pid, None)
        top = sorted(used.values(), key=lambda t: -t[2])[:most]
        shown = ([("main " + main[0], main[1], main[2])] if main else []) + top
        out[pid] = ", ".join(f"{name} {state} {share:.0%}" for name, state, share in shown)
    return out


def spinning_threads(
    pids: Sequence[int], window_s: float = 0.5, share: float = 0.8
) -> dict[int, list[str]]:
    """Threads of ``pids`` that used at least ``share`` of a core over ``window_s``, by
    process (``pid/tid name share``; only processes that have one): in a process that
    should be idle, a thread stuck in a loop."""
    out: dict[int, list[str]] = {}
    for pid, threads in thread_shares(pids, window_s).items():
        found = [
            f"{pid}/{tid} {n} {used:.0%}" for tid, (n, _, used) in threads.items() if used >= share
        ]
        if found:
            out[pid] = found
    return out


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` ('R', 'S', 'T', 'Z', ...), or None if gone."""
    fields = _read_stat(pid)
    return fields[0] if fields else None


def _other_threads(pid: int) -> bool:
    """Whether a thread other than ``pid``'s leader is still in its thread group."""
    try:
        return any(int(tid) != pid for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:  # gone meanwhile
        return False


def signal_landed(pid: int, sig: int, timeout_s: float = 10.0) -> None:
    """Return once the kernel shows ``sig``'s effect on ``pid``: gone, or a zombie with
    no thread left, after SIGKILL (its sockets are closed then), stopped after SIGSTOP,
    running after SIGCONT.

    Why wait: a signal is only queued when ``kill`` returns. A large process killed is
    still tearing down its memory, its listening sockets still completing handshakes,
    when the caller goes on; a fault "P died before D's pull" must have landed first.
    Why the threads: a leader shows ``Z`` as soon as it has exited itself, while the
    thread that drops the process's last reference to its memory and its files (and so
    closes its sockets) may still be tearing the memory down.
    Other signals return at once. Raises TimeoutError past ``timeout_s``."""
    import signal

    def done(state: str | None) -> bool:
        if state is None:
            return True
        if state in "ZXx":
            return sig != signal.SIGKILL or not _other_threads(pid)
        if sig == signal.SIGSTOP:
            return state in "Tt"
        if sig == signal.SIGCONT:
            return state not in "Tt"
        return sig != signal.SIGKILL

    deadline = time.monotonic() + timeout_s
    while not done(state := proc_state(pid)):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"signal {sig} to pid {pid} not landed after {timeout_s}s ({state})")
        time.sleep(0.005)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`.

    `killpg(pgid, 0)` is not enough: orphaned grandchildren are reparented to PID 1, which
    in a container may never reap them, so zombies would count as alive forever.
    """
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _read_stat(int(entry.name))
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in "ZXx":
            members.append(int(entry.name))
    return members


def same_process_alive(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (not a zombie)."""
    fields = _read_stat(pid)
    return fields is not None and len(fields) > 19 and fields[19] == start and fields[0] != "Z"


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root`` (pid -> start time), whatever its session or
    group: a process-group kill alone would orphan the ones in groups of their own."""
    parents: dict[int, list[int]] = defaultdict(list)
    starts: dict[int, str] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no procfs: only the root's own group can be reached
        return {}
    for pid in pids:
        fields = _read_stat(pid)
        if fields is not None and len(fields) > 19:
            parents[int(fields[1])].append(pid)
            starts[pid] = fields[19]
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for kid in parents.get(todo.pop(), []):
            if kid not in out and kid in starts:
                out[kid] = starts[kid]
                todo.append(kid)
    return out


def cmdline(pid: int, most: int = 120) -> str:
    """The command line of ``pid`` (its first ``most`` characters), "" once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:most]
