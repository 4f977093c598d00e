"""The tracker's memory is bounded by the loads in flight, not by past traffic.

Released at the drain, repeated reports allocate nothing, and what is remembered (recent
ids, the lazy deadline heap) stays within a bound, notify-only loads included.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest

from kvfail import Stage
from kvfail.tracker import RECENT_IDS_KEPT, LoadTracker
from tests.core.trackers import make_tracker


def _assert_nothing_retained(
    t: LoadTracker, round_trip: Callable[[int], None], *, rounds: int, what: str
) -> None:
    """After ``rounds`` calls of ``round_trip`` (numbered 2 on) ``t`` holds no load, and
    less than 64 KiB is still allocated over what two warm-up calls (0 and 1) left: those
    bring dict tables and the recent-id memory to their steady size, so only what a round
    keeps is counted."""
    tracemalloc.start()
    try:
        round_trip(0)
        round_trip(1)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for rnd in range(2, 2 + rounds):
            round_trip(rnd)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(t) == 0
    assert grown < 64 * 1024, f"retained {grown} bytes {what}"


@pytest.mark.usefixtures("quiet_kvfail_logs")
def test_memory_is_released_at_drain_and_repeated_reports_grow_nothing() -> None:
    t = make_tracker()

    def round_trip(_rnd: int) -> None:
        for i in range(2000):
            t.track(f"r{i}", [i, i + 1])
        for _ in range(5):  # repeated reports must not allocate per report
            for i in range(2000):
                t.failed(f"r{i}", Stage.TRANSFER, "x", settle=False)
        for i in range(2000):
            t.succeeded(f"r{i}")
        t.drain()

    _assert_nothing_retained(t, round_trip, rounds=5, what="after delivery")


def test_recent_id_memory_is_bounded() -> None:
    t = make_tracker()
    for i in range(RECENT_IDS_KEPT + 500):
        t.track(f"r{i}", [1])
        t.succeeded(f"r{i}")
        if i % 100 == 0:
            t.drain()
    t.drain()
    assert len(t._recent) + len(t._recent_old) <= 2 * RECENT_IDS_KEPT + 100


def test_deadline_heap_is_compacted() -> None:
    t = make_tracker(default_deadline_s=1000.0)
    for i in range(5000):
        t.track(f"r{i}", [1])
        t.succeeded(f"r{i}")
        if i % 10 == 0:
            t.drain()
    t.drain()
    assert len(t._deadlines) <= 2 * len(t) + 64


@pytest.mark.usefixtures("quiet_kvfail_logs")
def test_notify_only_loads_retain_no_memory_after_they_settle() -> None:
    t = make_tracker()

    def round_trip(rnd: int) -> None:
        for i in range(20_000):
            t.track(f"n{rnd}-{i}", [])
            t.succeeded(f"n{rnd}-{i}")
        t.drain()

    _assert_nothing_retained(t, round_trip, rounds=3, what="for 60,000 settled notify-only loads")


def test_deadline_heap_shrinks_when_loads_leave_without_new_tracks() -> None:
    """Bounded by the loads in flight, not by past traffic: delivery compacts too."""
    t = make_tracker(default_deadline_s=1000.0)
    for i in range(500):
        t.track(f"r{i}", [i] if i % 2 else [])  # half of them notify-only
    for i in range(500):
        t.succeeded(f"r{i}")
    t.drain()
    assert len(t) == 0 and len(t._deadlines) <= 64
