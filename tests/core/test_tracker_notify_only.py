"""Notify-only loads (no blocks, ``abort_immediately``): settled, and never reported (C7).

Their request is already gone from the scheduler, so no channel may name it, and no stat
or log line may claim it failed.
"""

from __future__ import annotations

import logging

import pytest

from kvfail import Stage
from kvfail.load_records import IDLE_REPORT
from tests.core.fakes import ManualClock
from tests.core.trackers import make_tracker


@pytest.mark.parametrize("blocks", [[], [[]], [[], []], None])
def test_notify_only_load_is_settled_but_never_reported(blocks: object) -> None:
    """C7: abort_immediately pulls carry no blocks and their request is already gone."""
    t = make_tracker()
    t.track("gone", blocks)
    t.failed("gone", Stage.TRANSFER, "peer refused")
    assert t.drain() is IDLE_REPORT
    assert len(t) == 0 and t.stats()["empty_loads"] == 1


def test_late_report_for_a_settled_notify_only_load_is_late() -> None:
    t = make_tracker()
    t.track("n1", [])
    t.succeeded("n1")
    assert not t.failed("n1", Stage.TRANSFER, "late")
    assert t.stats()["late_reports"] == 1 and t.stats()["unknown_reports"] == 0


def test_notify_only_load_past_its_deadline_is_not_counted_or_logged_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing is reported for it, so no stat or log line may claim a failed load."""
    clock = ManualClock()
    t = make_tracker(clock=clock, default_deadline_s=1.0)
    t.track("n1", [])
    clock.advance(2.0)
    with caplog.at_level(logging.DEBUG, logger="kvfail"):
        assert t.drain() is IDLE_REPORT
    stats = t.stats()
    assert len(t) == 0 and stats["empty_loads"] == 1
    assert stats["loads_failed"] == 0 and stats["stage.watchdog"] == 0
    assert stats["watchdog_fired"] == 0
    assert "load failed" not in caplog.text and "n1" in caplog.text


def test_failed_notify_only_load_is_not_counted_or_logged_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = make_tracker()
    t.track("n1", [])
    with caplog.at_level(logging.DEBUG, logger="kvfail"):
        t.failed("n1", Stage.PEER, "P refused the notification")
    assert t.drain() is IDLE_REPORT
    stats = t.stats()
    assert stats["loads_failed"] == 0 and stats["stage.peer"] == 0 and stats["empty_loads"] == 1
    assert "load failed" not in caplog.text and "P refused the notification" in caplog.text
