"""How much slower than its own CPU time this machine runs a thread right now.

Why: the suite's bounded waits (a real transport's budget, the wait for a silent peer, the
margin past a declared deadline) decide verdicts. On an oversubscribed machine a healthy
connector's thread gets a fraction of a core and misses a wait it keeps on an idle one.
Measuring that fraction lets the suite stretch its waits by what the machine takes, rather
than by a constant tuned on one machine.

Two measures, the larger wins: a short busy loop now (wall time over CPU time), and, where
the kernel keeps scheduler statistics, the main thread's time spent runnable but waiting
for a CPU since the last measurement, over its time on a CPU (the whole previous window,
not one instant).
"""

from __future__ import annotations

import time
from pathlib import Path

#: CPU time the probe spends: a few scheduler slices, short enough to run before every
#: scenario.
PROBE_CPU_S = 0.005
#: Never stretch a wait by more than this: a wait must stay bounded on any machine.
MAX_FACTOR = 3.0
#: The main thread's scheduler statistics: ns on a CPU, ns runnable and waiting, slices.
SCHEDSTAT = Path("/proc/self/schedstat")
#: A window whose main thread ran less than this is too short to say anything.
MIN_RUN_NS = 20_000_000


def probe_factor(cpu_s: float = PROBE_CPU_S) -> float:
    """Wall time over this thread's CPU time for a fixed busy loop: 1.0 where the thread
    runs unhindered, about N where it gets 1/N of a core (other processes, or other
    threads holding the GIL)."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu0 < cpu_s:
        pass
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return wall / cpu if cpu > 0 else 1.0


def read_schedstat() -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting for one) of this process's main thread; None where the
    kernel keeps no such statistics."""
    try:
        fields = SCHEDSTAT.read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


class ContentionMeter:
    """The factor by which the machine slows this process now, measured on demand."""

    def __init__(self, cap: float = MAX_FACTOR) -> None:
        self.cap = cap
        self._last = read_schedstat()

    def measure(self) -> float:
        """The larger of the probe and the window since the last call, in ``[1, cap]``."""
        factor = probe_factor()
        now = read_schedstat()
        if now is not None and self._last is not None:
            ran, waited = now[0] - self._last[0], now[1] - self._last[1]
            if ran >= MIN_RUN_NS and waited >= 0:
                factor = max(factor, 1.0 + waited / ran)
        if now is not None:
            self._last = now
        return min(max(factor, 1.0), self.cap)
