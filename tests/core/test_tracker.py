"""One test per property of the load tracker (:class:`kvfail.tracker.LoadTracker`)."""

from __future__ import annotations

import gc
import logging
import tracemalloc

import pytest

from kvfail import ALL_PEERS, LoadTracker, Stage
from kvfail.load_records import IDLE_REPORT
from kvfail.tracker import RECENT_IDS_KEPT
from tests.core.fakes import ManualClock


def make(**kw: object) -> LoadTracker:
    kw.setdefault("clock", ManualClock())
    return LoadTracker(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------- settling and delivery


def test_success_is_delivered_once_in_finished_only() -> None:
    t = make()
    t.track("r1", [[3, 4]])
    assert t.drain() is IDLE_REPORT  # nothing settled yet
    t.succeeded("r1")
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert not report.failed_recving and not report.invalid_block_ids
    assert t.drain() is IDLE_REPORT
    assert len(t) == 0


def test_failure_is_paired_with_finished_in_the_same_drain() -> None:
    """C2/C3: a failed load is reported finished, with its blocks, in one pass."""
    t = make()
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "reset by peer")
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert report.invalid_block_ids == {5, 6, 7}
    assert report.failures[0][1].stage is Stage.TRANSFER


def test_delivery_waits_for_every_peer() -> None:
    """C11: one peer's failure does not release blocks another peer may still write."""
    t = make()
    t.track("r1", [1, 2], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 died", peer="tp0")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="tp1")
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {1, 2}


def test_failure_is_sticky_against_later_success() -> None:
    t = make()
    t.track("r1", [1], peers=2)
    t.failed("r1", "transfer", "first peer failed", peer=0)
    t.succeeded("r1", peer=1)
    report = t.drain()
    assert report.invalid_block_ids == {1}
    assert t.stats()["loads_succeeded"] == 0


def test_failure_after_settle_but_before_drain_is_still_delivered() -> None:
    """No later than finished (C3): a failure that beats the drain is part of it."""
    t = make()
    t.track("r1", [9])
    t.succeeded("r1")
    t.failed("r1", Stage.NOTIFICATION, "notify failed", settle=False)
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {9}


def test_failure_is_idempotent_and_counted_once_per_request() -> None:
    t = make()
    t.track("r1", [1], peers=3)
    for peer in range(3):
        t.failed("r1", Stage.TRANSFER, f"peer {peer}", peer=peer)
    t.failed("r1", Stage.WATCHDOG, "again", settle=False)
    stats = t.stats()
    assert stats["loads_failed"] == 1
    assert stats["stage.transfer"] == 1 and stats["stage.watchdog"] == 0
    assert stats["duplicate_reports"] == 3
    assert t.drain().finished_recving == {"r1"}


def test_duplicate_success_from_one_peer_does_not_settle_the_others() -> None:
    """C8: a repeated report from one peer is not another peer's report."""
    t = make()
    t.track("r1", [1], peers=["a", "b"])
    t.succeeded("r1", peer="a")
    t.succeeded("r1", peer="a")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="b")
    assert t.drain().finished_recving == {"r1"}


def test_abandon_settles_all_peers() -> None:
    t = make()
    t.track("r1", [1, 2], peers=4)
    t.failed("r1", Stage.BOOTSTRAP, "bootstrap refused", peer=ALL_PEERS)
    assert t.drain().invalid_block_ids == {1, 2}


def test_expect_peers_widens_after_bootstrap() -> None:
    t = make()
    t.track("r1", [1])
    assert t.expect_peers("r1", ["p0", "p1"])
    t.succeeded("r1", peer="p0")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="p1")
    assert t.drain().finished_recving == {"r1"}


def test_narrowed_failure_keeps_a_valid_prefix() -> None:
    t = make()
    t.track("r1", [10, 11, 12, 13])
    t.failed("r1", Stage.TRANSFER, "partial", block_ids=[12, 13, 99])
    assert t.drain().invalid_block_ids == {12, 13}
    assert t.stats()["invalid_inputs"] == 1  # block 99 is not this load's


# --------------------------------------------------------------- routing


def test_single_group_routes_blocks_not_request_ids() -> None:
    t = make(num_kv_cache_groups=1)
    t.track("r1", [[1, 2]])
    t.failed("r1", Stage.PEER, "ERROR response")
    report = t.drain()
    assert report.invalid_block_ids == {1, 2} and not report.failed_recving


def test_several_groups_route_the_request_not_its_blocks() -> None:
    """C5: with HMA, flat block ids are ambiguous and vLLM >= 0.31 raises on them."""
    t = make(num_kv_cache_groups=2)
    t.track("r1", [[1, 2], [1, 5]])
    t.failed("r1", Stage.PEER, "err_reqs")
    report = t.drain()
    assert report.failed_recving == {"r1"} and report.finished_recving == {"r1"}
    assert not report.invalid_block_ids


def test_flat_and_nested_block_ids_flatten_identically() -> None:
    a, b = make(), make()
    a.track("r", [1, 2, 3])
    b.track("r", [[1, 2], [3]])
    for t in (a, b):
        t.failed("r", "transfer", "x")
    assert a.drain().invalid_block_ids == b.drain().invalid_block_ids == {1, 2, 3}


# --------------------------------------------------------------- empty-block guard


@pytest.mark.parametrize("blocks", [[], [[]], [[], []], None])
def test_notify_only_load_is_settled_but_never_reported(blocks: object) -> None:
    """C7: abort_immediately pulls carry no blocks and their request is already gone."""
    t = make()
    t.track("gone", blocks)
    t.failed("gone", Stage.TRANSFER, "peer refused")
    assert t.drain() is IDLE_REPORT
    assert len(t) == 0 and t.stats()["empty_loads"] == 1


# --------------------------------------------------------------- unknown and late ids


def test_unknown_ids_are_counted_and_never_delivered(caplog: pytest.LogCaptureFixture) -> None:
    t = make()
    with caplog.at_level(logging.WARNING, logger="kvfail"):
        assert not t.failed("ghost", Stage.TRANSFER, "x")
        assert not t.succeeded("ghost")
    assert t.drain() is IDLE_REPORT
    assert t.stats()["unknown_reports"] == 2
    assert "unknown request" in caplog.text and "ghost" in caplog.text


def test_reports_after_delivery_are_late_not_delivered() -> None:
    t = make()
    t.track("r1", [1])
    t.succeeded("r1")
    t.drain()
    assert not t.failed("r1", Stage.TRANSFER, "too late")
    assert not t.succeeded("r1")
    assert t.drain() is IDLE_REPORT
    assert t.stats()["late_reports"] == 2 and t.stats()["loads_failed"] == 0


def test_retrack_after_delivery_starts_afresh() -> None:
    """Under recompute the same request id may load again."""
    t = make()
    t.track("r1", [1])
    t.failed("r1", "transfer", "x")
    t.drain()
    assert t.track("r1", [2])
    t.succeeded("r1")
    report = t.drain()
    assert report.finished_recving == {"r1"} and not report.invalid_block_ids


def test_duplicate_track_keeps_the_first_load() -> None:
    t = make()
    assert t.track("r1", [1])
    assert not t.track("r1", [2])
    t.failed("r1", "transfer", "x")
    assert t.drain().invalid_block_ids == {1}
    assert t.stats()["duplicate_tracks"] == 1


# --------------------------------------------------------------- watchdog


def test_watchdog_fails_an_overdue_load_at_the_next_drain() -> None:
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=5.0)
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
    t = make(clock=clock, default_deadline_s=1.0)
    t.track("r1", [1])
    t.succeeded("r1")
    clock.advance(2.0)
    assert t.drain().finished_recving == {"r1"}
    assert t.stats()["watchdog_fired"] == 0


def test_watchdog_keeps_first_failure_stage_and_settles_silent_peers() -> None:
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0)
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

    t = make(clock=clock, default_deadline_s=1.0, fence=fence)
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

    t = make(clock=clock, default_deadline_s=1.0, fence=fence)
    t.track("r1", [4])
    clock.advance(2.0)
    assert t.drain() is IDLE_REPORT
    assert t.is_tracked("r1")


def test_watchdog_uses_no_threads() -> None:
    import threading

    before = threading.active_count()
    t = make(default_deadline_s=0.5)
    for i in range(100):
        t.track(f"r{i}", [i])
    assert threading.active_count() == before


# --------------------------------------------------------------- stats and logs


def test_one_structured_log_line_per_failed_request(caplog: pytest.LogCaptureFixture) -> None:
    t = make(name="mooncake")
    t.track("r1", [1], peers=2)
    with caplog.at_level(logging.ERROR, logger="kvfail"):
        t.failed("r1", Stage.HANDSHAKE, "zmq timeout", peer=0)
        t.failed("r1", Stage.TRANSFER, "again", peer=1)
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1
    fields = lines[0].kvfail  # type: ignore[attr-defined]
    assert fields["req_id"] == "r1" and fields["stage"] == "handshake"
    assert fields["connector"] == "mooncake" and fields["reason"] == "zmq timeout"
    assert "stage='handshake'" in lines[0].getMessage()


def test_interval_stats_reset_and_totals_accumulate() -> None:
    t = make()
    for i in range(3):
        t.track(f"r{i}", [i])
        t.failed(f"r{i}", Stage.PEER, "x")
    first = t.take_interval_stats()
    assert first["stage.peer"] == 3
    assert t.take_interval_stats().empty
    assert t.stats()["stage.peer"] == 3


def test_stats_keys_are_stable() -> None:
    keys = set(make().stats().as_dict())
    assert {"loads_failed", "unknown_reports", "stage.watchdog", "stage.transfer"} <= keys


# --------------------------------------------------------------- memory


@pytest.mark.usefixtures("quiet_kvfail_logs")
def test_memory_is_released_at_drain_and_repeated_reports_grow_nothing() -> None:
    t = make()

    def round_trip(n: int) -> None:
        for i in range(n):
            t.track(f"r{i}", [i, i + 1])
        for _ in range(5):  # repeated reports must not allocate per report
            for i in range(n):
                t.failed(f"r{i}", Stage.TRANSFER, "x", settle=False)
        for i in range(n):
            t.succeeded(f"r{i}")
        t.drain()

    tracemalloc.start()
    round_trip(2000)  # warm up: dict tables and the recent-id memory reach steady size
    round_trip(2000)
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(5):
        round_trip(2000)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(t) == 0
    assert grown < 64 * 1024, f"retained {grown} bytes after delivery"


def test_recent_id_memory_is_bounded() -> None:
    t = make()
    for i in range(RECENT_IDS_KEPT + 500):
        t.track(f"r{i}", [1])
        t.succeeded(f"r{i}")
        if i % 100 == 0:
            t.drain()
    t.drain()
    assert len(t._recent) + len(t._recent_old) <= 2 * RECENT_IDS_KEPT + 100


def test_deadline_heap_is_compacted() -> None:
    t = make(default_deadline_s=1000.0)
    for i in range(5000):
        t.track(f"r{i}", [1])
        t.succeeded(f"r{i}")
        if i % 10 == 0:
            t.drain()
    t.drain()
    assert len(t._deadlines) <= 2 * len(t) + 64


# --------------------------------------------------------------- narrowing across peers
# Under recompute the scheduler keeps every block before the first reported one, so a
# failure must name every block that any peer's outcome leaves possibly unwritten.


def test_whole_load_failure_then_narrowed_failure_delivers_every_block() -> None:
    t = make()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 wrote nothing", peer="tp0")
    t.failed("r1", Stage.TRANSFER, "tp1 lost one block", peer="tp1", block_ids=[13])
    assert t.drain().invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failure_then_whole_load_failure_delivers_every_block() -> None:
    t = make()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost one block", peer="tp0", block_ids=[13])
    t.failed("r1", Stage.TRANSFER, "tp1 wrote nothing", peer="tp1")
    assert t.drain().invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failure_then_silent_peer_delivers_every_block() -> None:
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0)
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost one block", peer="tp0", block_ids=[13])
    clock.advance(2.0)  # tp1 never answers
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert report.invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failures_from_several_peers_are_united() -> None:
    t = make()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1", "tp2"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost 12", peer="tp0", block_ids=[12])
    t.failed("r1", Stage.TRANSFER, "tp1 lost 13", peer="tp1", block_ids=[13])
    t.succeeded("r1", peer="tp2")
    assert t.drain().invalid_block_ids == {12, 13}


def test_narrowing_to_no_block_of_the_load_fails_every_block() -> None:
    """A narrowing we cannot use says nothing about which blocks arrived."""
    t = make()
    t.track("r1", [10, 11], peers=2)
    t.failed("r1", Stage.TRANSFER, "x", peer=0, block_ids=[11])
    t.failed("r1", Stage.TRANSFER, "y", peer=1, block_ids=[99])
    assert t.drain().invalid_block_ids == {10, 11}


# --------------------------------------------------------------- no peers


def _no_peers_by_track(t: LoadTracker, req: str, blocks: list[int]) -> None:
    t.track(req, blocks, peers=0)


def _no_peers_by_empty_list(t: LoadTracker, req: str, blocks: list[int]) -> None:
    t.track(req, blocks, peers=[])


def _no_peers_by_expect(t: LoadTracker, req: str, blocks: list[int]) -> None:
    t.track(req, blocks)
    t.expect_peers(req, [])


def _no_peers_by_expect_zero(t: LoadTracker, req: str, blocks: list[int]) -> None:
    t.track(req, blocks)
    t.expect_peers(req, 0)


NO_PEERS = [
    _no_peers_by_track,
    _no_peers_by_empty_list,
    _no_peers_by_expect,
    _no_peers_by_expect_zero,
]


@pytest.mark.parametrize("spelling", NO_PEERS, ids=lambda f: f.__name__.removeprefix("_"))
def test_a_load_expecting_data_from_nobody_fails(spelling: object) -> None:
    """Nobody will write these blocks: every spelling of "no peers" fails the load."""
    t = make()
    spelling(t, "r1", [4, 5])  # type: ignore[operator]
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {4, 5}
    assert report.failures[0][1].stage is Stage.INTERNAL
    stats = t.stats()
    assert (stats["loads_failed"], stats["loads_succeeded"], stats["invalid_inputs"]) == (1, 0, 1)


@pytest.mark.parametrize("spelling", NO_PEERS, ids=lambda f: f.__name__.removeprefix("_"))
def test_a_notify_only_load_with_no_peers_is_settled_quietly(spelling: object) -> None:
    """No blocks to load: nothing is missing, and nothing may be reported (C7)."""
    t = make()
    spelling(t, "n1", [])  # type: ignore[operator]
    assert t.drain() is IDLE_REPORT
    stats = t.stats()
    assert len(t) == 0 and stats["empty_loads"] == 1 and stats["loads_failed"] == 0


# --------------------------------------------------------------- notify-only loads


@pytest.mark.usefixtures("quiet_kvfail_logs")
def test_notify_only_loads_retain_no_memory_after_they_settle() -> None:
    t = make()

    def round_trip(rnd: int, n: int) -> None:
        for i in range(n):
            t.track(f"n{rnd}-{i}", [])
            t.succeeded(f"n{rnd}-{i}")
        t.drain()

    tracemalloc.start()
    round_trip(0, 20_000)  # warm up: the recent-id memory reaches its steady size
    round_trip(1, 20_000)
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    for rnd in range(2, 5):
        round_trip(rnd, 20_000)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(t) == 0
    assert grown < 64 * 1024, f"retained {grown} bytes for 60,000 settled notify-only loads"


def test_late_report_for_a_settled_notify_only_load_is_late() -> None:
    t = make()
    t.track("n1", [])
    t.succeeded("n1")
    assert not t.failed("n1", Stage.TRANSFER, "late")
    assert t.stats()["late_reports"] == 1 and t.stats()["unknown_reports"] == 0


def test_notify_only_load_past_its_deadline_is_not_counted_or_logged_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing is reported for it, so no stat or log line may claim a failed load."""
    clock = ManualClock()
    t = make(clock=clock, default_deadline_s=1.0)
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
    t = make()
    t.track("n1", [])
    with caplog.at_level(logging.DEBUG, logger="kvfail"):
        t.failed("n1", Stage.PEER, "P refused the notification")
    assert t.drain() is IDLE_REPORT
    stats = t.stats()
    assert stats["loads_failed"] == 0 and stats["stage.peer"] == 0 and stats["empty_loads"] == 1
    assert "load failed" not in caplog.text and "P refused the notification" in caplog.text


def test_expect_peers_after_the_load_settled_is_a_late_report() -> None:
    t = make()
    t.track("r1", [1])
    t.succeeded("r1")
    assert not t.expect_peers("r1", 2)  # settled, waiting for the drain
    assert t.stats()["late_reports"] == 1 and t.stats()["unknown_reports"] == 0
    assert t.drain().finished_recving == {"r1"}


def test_deadline_heap_shrinks_when_loads_leave_without_new_tracks() -> None:
    """Bounded by the loads in flight, not by past traffic: delivery compacts too."""
    t = make(default_deadline_s=1000.0)
    for i in range(500):
        t.track(f"r{i}", [i] if i % 2 else [])  # half of them notify-only
    for i in range(500):
        t.succeeded(f"r{i}")
    t.drain()
    assert len(t) == 0 and len(t._deadlines) <= 64


# --------------------------------------------------------------- reporting channels


def test_without_block_level_a_narrowed_failure_goes_by_request_id() -> None:
    """Where block level is gone (vLLM PR #42461), even one lost block fails the whole
    request by id: the scheduler then recomputes it all, never a kept prefix."""
    t = make(block_level_available=False)
    assert t.request_level
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "block 6 lost", block_ids=[6])
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.failed_recving == {"r1"}
    assert not report.invalid_block_ids and not report.unreportable


def test_without_the_request_channel_a_failure_goes_by_block() -> None:
    t = make(request_level_available=False)
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "block 6 lost", block_ids=[6])
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {6}
    assert not report.failed_recving and not report.unreportable


def test_a_failure_no_channel_can_carry_is_never_delivered_as_finished() -> None:
    """No usable block id and no request channel (vLLM < 0.30): the load is handed back
    as unreportable, outside ``finished_recving`` (the mixin raises on it)."""
    t = make(request_level_available=False)
    t.track("bad", [-1, "x"])
    t.track("ok", [3])
    t.failed("bad", Stage.PARAMS, "nothing to pull into", peer=ALL_PEERS)
    t.succeeded("ok")
    report = t.drain()
    assert report.unreportable == {"bad"} and report
    assert report.finished_recving == {"ok"}
    assert not report.failed_recving and not report.invalid_block_ids
    assert t.failure_of("bad") is None and len(t) == 0  # delivered to the caller, once
