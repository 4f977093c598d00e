"""The worker half of the quarantine: fail fast, and hold the blocks until fenced.

A load whose transfer may still write (a fence that does not hold at the deadline, or a
report with ``fenced=False``) is delivered at once, request-level, and its id is named in
the step's hold notice; its release comes with a later step's notice, once fenced.
"""

from __future__ import annotations

import pytest

from kvfail import FailureReporterMixin, LoadTracker, Stage
from kvfail.load_records import IDLE_REPORT
from tests.core.fakes import ManualClock
from tests.core.trackers import make_tracker


def make(**kw: object) -> LoadTracker:
    kw.setdefault("quarantine", True)
    return make_tracker(**kw)


def test_an_unfenced_deadline_fails_at_once_and_holds_until_the_fence_holds() -> None:
    clock = ManualClock()
    verdicts = [False, False, True]

    def fence(req_id: str) -> bool:
        return verdicts.pop(0)

    t = make(clock=clock, default_deadline_s=1.0, fence=fence)
    t.track("r1", [4, 5])
    clock.advance(2.0)
    report = t.drain()
    # Request-level even with one group: recompute must not reuse the held blocks.
    assert report.finished_recving == {"r1"} and report.failed_recving == {"r1"}
    assert not report.invalid_block_ids
    assert report.failures[0][1].stage is Stage.WATCHDOG
    assert t.take_quarantine_notice() == ({"r1"}, frozenset())
    assert t.is_quarantined("r1") and t.quarantined_blocks == 2 and len(t) == 0
    t.drain()  # the fence is retried at each drain: still writing
    assert t.take_quarantine_notice() == (frozenset(), frozenset())
    t.drain()
    assert t.take_quarantine_notice() == (frozenset(), {"r1"})
    assert not t.is_quarantined("r1") and t.quarantined_blocks == 0
    stats = t.stats()
    assert (stats["loads_quarantined"], stats["quarantine_released"]) == (1, 1)
    assert stats["loads_failed"] == 1 and stats["fence_deferred"] == 0


def test_a_report_that_says_unfenced_is_held_until_fenced_is_called() -> None:
    t = make()
    t.track("r1", [[1, 2]], peers=["a", "b"])
    t.failed("r1", Stage.TRANSFER, "read handle would not release", peer="a", fenced=False)
    assert t.drain() is IDLE_REPORT  # peer b still to settle
    t.succeeded("r1", peer="b")
    report = t.drain()
    assert report.failed_recving == {"r1"} and report.finished_recving == {"r1"}
    assert t.take_quarantine_notice() == ({"r1"}, frozenset())
    t.succeeded("r1", peer="a")  # a late report changes nothing: counted as late
    assert t.is_quarantined("r1") and t.stats()["late_reports"] == 1
    assert t.fenced("r1")
    assert t.take_quarantine_notice() == (frozenset(), {"r1"})
    assert not t.fenced("r1")  # nothing left to fence: counted, never raised
    assert t.stats()["late_reports"] == 2


def test_fenced_before_delivery_is_an_ordinary_failure() -> None:
    t = make()
    t.track("r1", [7, 8])
    t.failed("r1", Stage.TRANSFER, "x", fenced=False, settle=False)
    assert t.fenced("r1")  # the transfer ended before the step: nothing to hold
    t.succeeded("r1")
    report = t.drain()
    assert report.invalid_block_ids == {7, 8} and not report.failed_recving
    assert t.take_quarantine_notice() == (frozenset(), frozenset())


def test_a_fence_that_holds_at_the_deadline_quarantines_nothing() -> None:
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0, fence=lambda r: True)
    t.track("r1", [3])
    clock.advance(2.0)
    assert t.drain().invalid_block_ids == {3}
    assert t.take_quarantine_notice() == (frozenset(), frozenset())


def test_without_quarantine_an_unfenced_report_is_refused_and_the_deadline_holds() -> None:
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0, fence=lambda r: False, quarantine=False)
    t.track("r1", [3])
    with pytest.raises(ValueError, match="quarantine"):
        t.failed("r1", Stage.TRANSFER, "x", fenced=False)
    clock.advance(2.0)
    assert t.drain() is IDLE_REPORT  # held, as before quarantine existed
    assert t.stats()["fence_deferred"] == 1


def test_fence_retries_survive_heap_compaction() -> None:
    clock = ManualClock()
    fenced = {"r0": False}
    t = make(clock=clock, default_deadline_s=1.0, fence=lambda r: fenced.get(r, True))
    t.track("r0", [1])
    clock.advance(2.0)
    t.drain()
    for i in range(1, 500):  # much traffic through the heap while r0 is held
        t.track(f"r{i}", [2])
        t.succeeded(f"r{i}")
        t.drain()
    assert t.is_quarantined("r0")
    fenced["r0"] = True
    t.drain()
    assert not t.is_quarantined("r0")


class Worker(FailureReporterMixin):
    def __init__(self, rank: int) -> None:
        self.init_failure_reporter(
            num_kv_cache_groups=1, quarantine=True, rank=rank, clock=ManualClock()
        )


def test_the_mixin_names_its_rank_in_each_notice() -> None:
    w = Worker(rank=1)
    w.track_load("r1", [1, 2])
    w.load_failed("r1", Stage.PEER, "slow P gave up on", fenced=False)
    w.drain_step()
    notice = w.take_quarantine_notice()
    assert notice.held == {("r1", 1)} and not notice.released
    w.load_fenced("r1")
    assert w.take_quarantine_notice().released == {("r1", 1)}


def test_without_the_request_channel_a_held_load_names_every_block() -> None:
    """A vLLM without ``failed_recving`` (0.29) is told by block: every block of the
    load, so the scheduler half can turn it into a request-level failure."""
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0, fence=lambda r: False)
    t.request_level_available = False
    t.track("r1", [4, 5, 6])
    clock.advance(2.0)
    report = t.drain()
    assert report.finished_recving == {"r1"} and not report.failed_recving
    assert report.invalid_block_ids == {4, 5, 6}
    assert t.take_quarantine_notice() == ({"r1"}, frozenset())
    assert t.is_quarantined("r1") and t.quarantined_blocks == 3
