"""Settling and delivery (:class:`kvfail.tracker.LoadTracker`): one test per property.

A load is delivered once, when every peer has settled, its failure sticky and paired with
finished in the same drain; narrowed failures never shrink what another peer left
unwritten; a load nobody will write fails; reports for ids not in flight are counted.
"""

from __future__ import annotations

import logging

import pytest

from kvfail import ALL_PEERS, LoadTracker, Stage
from kvfail.load_records import IDLE_REPORT
from tests.core.fakes import ManualClock
from tests.core.trackers import make_tracker

# --------------------------------------------------------------- settling and delivery


def test_success_is_delivered_once_in_finished_only() -> None:
    t = make_tracker()
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
    t = make_tracker()
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "reset by peer")
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert report.invalid_block_ids == {5, 6, 7}
    assert report.failures[0][1].stage is Stage.TRANSFER


def test_delivery_waits_for_every_peer() -> None:
    """C11: one peer's failure does not release blocks another peer may still write."""
    t = make_tracker()
    t.track("r1", [1, 2], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 died", peer="tp0")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="tp1")
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {1, 2}


def test_failure_is_sticky_against_later_success() -> None:
    t = make_tracker()
    t.track("r1", [1], peers=2)
    t.failed("r1", "transfer", "first peer failed", peer=0)
    t.succeeded("r1", peer=1)
    report = t.drain()
    assert report.invalid_block_ids == {1}
    assert t.stats()["loads_succeeded"] == 0


def test_failure_after_settle_but_before_drain_is_still_delivered() -> None:
    """No later than finished (C3): a failure that beats the drain is part of it."""
    t = make_tracker()
    t.track("r1", [9])
    t.succeeded("r1")
    t.failed("r1", Stage.NOTIFICATION, "notify failed", settle=False)
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {9}


def test_failure_is_idempotent_and_counted_once_per_request() -> None:
    t = make_tracker()
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
    t = make_tracker()
    t.track("r1", [1], peers=["a", "b"])
    t.succeeded("r1", peer="a")
    t.succeeded("r1", peer="a")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="b")
    assert t.drain().finished_recving == {"r1"}


def test_abandon_settles_all_peers() -> None:
    t = make_tracker()
    t.track("r1", [1, 2], peers=4)
    t.failed("r1", Stage.BOOTSTRAP, "bootstrap refused", peer=ALL_PEERS)
    assert t.drain().invalid_block_ids == {1, 2}


def test_expect_peers_widens_after_bootstrap() -> None:
    t = make_tracker()
    t.track("r1", [1])
    assert t.expect_peers("r1", ["p0", "p1"])
    t.succeeded("r1", peer="p0")
    assert t.drain() is IDLE_REPORT
    t.succeeded("r1", peer="p1")
    assert t.drain().finished_recving == {"r1"}


def test_narrowed_failure_keeps_a_valid_prefix() -> None:
    t = make_tracker()
    t.track("r1", [10, 11, 12, 13])
    t.failed("r1", Stage.TRANSFER, "partial", block_ids=[12, 13, 99])
    assert t.drain().invalid_block_ids == {12, 13}
    assert t.stats()["invalid_inputs"] == 1  # block 99 is not this load's


# --------------------------------------------------------------- narrowing across peers
# Under recompute the scheduler keeps every block before the first reported one, so a
# failure must name every block that any peer's outcome leaves possibly unwritten.


def test_whole_load_failure_then_narrowed_failure_delivers_every_block() -> None:
    t = make_tracker()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 wrote nothing", peer="tp0")
    t.failed("r1", Stage.TRANSFER, "tp1 lost one block", peer="tp1", block_ids=[13])
    assert t.drain().invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failure_then_whole_load_failure_delivers_every_block() -> None:
    t = make_tracker()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost one block", peer="tp0", block_ids=[13])
    t.failed("r1", Stage.TRANSFER, "tp1 wrote nothing", peer="tp1")
    assert t.drain().invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failure_then_silent_peer_delivers_every_block() -> None:
    clock = ManualClock()
    t = make_tracker(clock=clock, default_deadline_s=1.0)
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost one block", peer="tp0", block_ids=[13])
    clock.advance(2.0)  # tp1 never answers
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert report.invalid_block_ids == {10, 11, 12, 13}


def test_narrowed_failures_from_several_peers_are_united() -> None:
    t = make_tracker()
    t.track("r1", [10, 11, 12, 13], peers=["tp0", "tp1", "tp2"])
    t.failed("r1", Stage.TRANSFER, "tp0 lost 12", peer="tp0", block_ids=[12])
    t.failed("r1", Stage.TRANSFER, "tp1 lost 13", peer="tp1", block_ids=[13])
    t.succeeded("r1", peer="tp2")
    assert t.drain().invalid_block_ids == {12, 13}


def test_narrowing_to_no_block_of_the_load_fails_every_block() -> None:
    """A narrowing we cannot use says nothing about which blocks arrived."""
    t = make_tracker()
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
    t = make_tracker()
    spelling(t, "r1", [4, 5])  # type: ignore[operator]
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {4, 5}
    assert report.failures[0][1].stage is Stage.INTERNAL
    stats = t.stats()
    assert (stats["loads_failed"], stats["loads_succeeded"], stats["invalid_inputs"]) == (1, 0, 1)


@pytest.mark.parametrize("spelling", NO_PEERS, ids=lambda f: f.__name__.removeprefix("_"))
def test_a_notify_only_load_with_no_peers_is_settled_quietly(spelling: object) -> None:
    """No blocks to load: nothing is missing, and nothing may be reported (C7)."""
    t = make_tracker()
    spelling(t, "n1", [])  # type: ignore[operator]
    assert t.drain() is IDLE_REPORT
    stats = t.stats()
    assert len(t) == 0 and stats["empty_loads"] == 1 and stats["loads_failed"] == 0


# --------------------------------------------------------------- unknown and late ids


def test_unknown_ids_are_counted_and_never_delivered(caplog: pytest.LogCaptureFixture) -> None:
    t = make_tracker()
    with caplog.at_level(logging.WARNING, logger="kvfail"):
        assert not t.failed("ghost", Stage.TRANSFER, "x")
        assert not t.succeeded("ghost")
    assert t.drain() is IDLE_REPORT
    assert t.stats()["unknown_reports"] == 2
    assert "unknown request" in caplog.text and "ghost" in caplog.text


def test_reports_after_delivery_are_late_not_delivered() -> None:
    t = make_tracker()
    t.track("r1", [1])
    t.succeeded("r1")
    t.drain()
    assert not t.failed("r1", Stage.TRANSFER, "too late")
    assert not t.succeeded("r1")
    assert t.drain() is IDLE_REPORT
    assert t.stats()["late_reports"] == 2 and t.stats()["loads_failed"] == 0


def test_retrack_after_delivery_starts_afresh() -> None:
    """Under recompute the same request id may load again."""
    t = make_tracker()
    t.track("r1", [1])
    t.failed("r1", "transfer", "x")
    t.drain()
    assert t.track("r1", [2])
    t.succeeded("r1")
    report = t.drain()
    assert report.finished_recving == {"r1"} and not report.invalid_block_ids


def test_duplicate_track_keeps_the_first_load() -> None:
    t = make_tracker()
    assert t.track("r1", [1])
    assert not t.track("r1", [2])
    t.failed("r1", "transfer", "x")
    assert t.drain().invalid_block_ids == {1}
    assert t.stats()["duplicate_tracks"] == 1


def test_expect_peers_after_the_load_settled_is_a_late_report() -> None:
    t = make_tracker()
    t.track("r1", [1])
    t.succeeded("r1")
    assert not t.expect_peers("r1", 2)  # settled, waiting for the drain
    assert t.stats()["late_reports"] == 1 and t.stats()["unknown_reports"] == 0
    assert t.drain().finished_recving == {"r1"}
