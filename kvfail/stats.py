"""Counters for failed loads and for reports that had to be refused.

Two views are kept: cumulative totals (for tests, the CLI and logs) and an interval view
that a vLLM-facing layer drains each time the engine asks for connector stats, because
vLLM's ``KVConnectorStats`` are per-interval and aggregated across workers. Counters are
mutated only under the tracker's lock, so this class has no lock of its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvfail.stages import Stage

#: Counters that are not per-stage. Kept as a tuple so exported keys are stable.
EVENT_COUNTERS: tuple[str, ...] = (
    "loads_tracked",
    "loads_succeeded",
    "loads_failed",
    "empty_loads",
    "unknown_reports",
    "late_reports",
    "duplicate_reports",
    "duplicate_tracks",
    "invalid_inputs",
    "watchdog_fired",
    "fence_deferred",
    "loads_quarantined",
    "quarantine_released",
)


@dataclass(slots=True)
class FailureStats:
    """A snapshot of counters. ``failed_by_stage`` counts each failed request once."""

    failed_by_stage: Counter[Stage] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)

    def copy(self) -> FailureStats:
        return FailureStats(Counter(self.failed_by_stage), Counter(self.events))

    def __getitem__(self, name: str) -> int:
        """``stats["loads_failed"]`` or ``stats["stage.watchdog"]``."""
        if name.startswith("stage."):
            return self.failed_by_stage[Stage(name.removeprefix("stage."))]
        if name not in EVENT_COUNTERS:
            raise KeyError(name)
        return self.events[name]

    def as_dict(self) -> dict[str, int]:
        """Flat, stable keys: every event counter and one ``stage.<name>`` per stage."""
        out = {name: self.events[name] for name in EVENT_COUNTERS}
        out.update({f"stage.{s.value}": self.failed_by_stage[s] for s in Stage})
        return out

    def merge(self, other: FailureStats) -> FailureStats:
        """Sum two snapshots, e.g. from several TP workers."""
        return FailureStats(
            self.failed_by_stage + other.failed_by_stage, self.events + other.events
        )

    @property
    def empty(self) -> bool:
        return not (self.failed_by_stage or +self.events)


@dataclass(slots=True)
class StatsRecorder:
    """Cumulative and per-interval counters, updated together."""

    total: FailureStats = field(default_factory=FailureStats)
    interval: FailureStats = field(default_factory=FailureStats)

    def event(self, name: str, n: int = 1) -> None:
        self.total.events[name] += n
        self.interval.events[name] += n

    def failed(self, stage: Stage) -> None:
        self.total.failed_by_stage[stage] += 1
        self.interval.failed_by_stage[stage] += 1
        self.event("loads_failed")

    def take_interval(self) -> FailureStats:
        taken, self.interval = self.interval, FailureStats()
        return taken
