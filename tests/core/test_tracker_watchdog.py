"""The tracker's deadlines (:mod:`kvfail.tracker_watchdog`): an overdue load fails at the
next drain, and is delivered only once the fence says its transfer can no longer write.
"""

from __future__ import annotations

from kvfail import Stage
from kvfail.load_records import IDLE_REPORT
from tests.core.fakes import ManualClock
from tests.core.trackers import make_tracker


def test_watchdog_fails_an_overdue_load_at_the_next_drain() -> None:
    clock = ManualClock()
    t = make_tracker(clock=clock, default_deadline_s=5.0)
    t.track("slow", [1, 2])
    t.track("quick", [3], deadline_s=100.0)
    clock.advance(4.9)
    assert t.drain() is IDLE_REPORT
    clock.advance(0.2)
    report = t.drain()
    assert report.finished_recving == {"slow"} and report.invalid_block_ids == {1, 2}
    assert report.failures[0][1].stage is Stage.WATCHDOG
    assert t.is_tracked("quick")
    assert t.stats()["watchdog_fired"] == 1


def test_watchdog_ignores_loads_that_settled_in_time() -> None:
    clock = ManualClock()
    t = make_tracker(clock=clock, default_deadline_s=1.0)
    t.track("r1", [1])
    t.succeeded("r1")
    clock.advance(2.0)
    assert t.drain().finished_recving == {"r1"}
    assert t.stats()["watchdog_fired"] == 0


def test_watchdog_keeps_first_failure_stage_and_settles_silent_peers() -> None:
    clock = ManualClock()
    t = make_tracker(clock=clock, default_deadline_s=1.0)
    t.track("r1", [1], peers=2)
    t.failed("r1", Stage.TRANSFER, "peer 0 failed", peer=0)
    clock.advance(1.5)
    report = t.drain()
    assert report.failures[0][1].stage is Stage.TRANSFER
    assert report.finished_recving == {"r1"}


def test_fence_refusal_holds_the_load_until_it_can_be_fenced() -> None:
    """C11: a transfer that may still write keeps its blocks until it is fenced."""
    clock = ManualClock()
    verdicts = [False, False, True]
    asked: list[str] = []

    def fence(req_id: str) -> bool:
        asked.append(req_id)
        return verdicts.pop(0)

    t = make_tracker(clock=clock, default_deadline_s=1.0, fence=fence)
    t.track("r1", [4])
    clock.advance(2.0)
    assert t.drain() is IDLE_REPORT
    assert t.drain() is IDLE_REPORT
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {4}
    assert asked == ["r1"] * 3
    stats = t.stats()
    assert stats["fence_deferred"] == 2 and stats["loads_failed"] == 1


def test_a_raising_fence_counts_as_not_fenced() -> None:
    clock = ManualClock()

    def fence(req_id: str) -> bool:
        raise OSError("release failed")

    t = make_tracker(clock=clock, default_deadline_s=1.0, fence=fence)
    t.track("r1", [4])
    clock.advance(2.0)
    assert t.drain() is IDLE_REPORT
    assert t.is_tracked("r1")


def test_watchdog_uses_no_threads() -> None:
    import threading

    before = threading.active_count()
    t = make_tracker(default_deadline_s=0.5)
    for i in range(100):
        t.track(f"r{i}", [i])
    assert threading.active_count() == before
