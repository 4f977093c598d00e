"""Bad input gets a clear log line and a counter, and loses no request."""

from __future__ import annotations

import logging

import pytest

from kvfail import LoadTracker, Stage
from kvfail.blocks import normalise_block_ids


def test_non_int_and_negative_block_ids_fail_the_load_but_keep_it() -> None:
    t = LoadTracker()
    assert t.track("r1", [1, -2, "3", 4.5, True, 5])
    assert t.failure_of("r1") is not None  # failed at once, delivered when its peer settles
    t.succeeded("r1")
    report = t.drain()
    assert report.finished_recving == {"r1"}
    assert report.invalid_block_ids == {1, 5}
    assert report.failures[0][1].stage is Stage.INTERNAL
    assert "invalid block id" in report.failures[0][1].reason
    assert t.stats()["invalid_inputs"] == 1


def test_all_block_ids_invalid_falls_back_to_the_request_channel() -> None:
    """We cannot name a block, yet the scheduler holds some: fail the request by id."""
    t = LoadTracker()
    t.track("r1", [[-1, None]])
    t.succeeded("r1")
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.failed_recving == {"r1"}


def test_numpy_style_ints_are_accepted() -> None:
    class IndexLike:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    assert normalise_block_ids([IndexLike(3), 4]).flat == (3, 4)


def test_non_list_block_ids_are_rejected_clearly() -> None:
    assert "must be a list" in normalise_block_ids(7).problem
    assert "must be a list" in normalise_block_ids("12").problem


@pytest.mark.parametrize("req_id", [None, 3, ""])
def test_non_string_request_ids_are_refused(req_id: object) -> None:
    t = LoadTracker()
    assert not t.track(req_id, [1])  # type: ignore[arg-type]
    assert len(t) == 0 and t.stats()["invalid_inputs"] == 1


def test_unknown_stage_strings_become_internal() -> None:
    t = LoadTracker()
    t.track("r1", [1])
    t.failed("r1", "no-such-stage", "x")
    assert t.drain().failures[0][1].stage is Stage.INTERNAL


def test_zero_peers_cannot_stall_a_load() -> None:
    t = LoadTracker()
    t.track("r1", [1], peers=0)
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {1}


def test_empty_groups_mixed_with_blocks() -> None:
    t = LoadTracker(num_kv_cache_groups=2)
    t.track("r1", [[], [7]])
    t.failed("r1", Stage.TRANSFER, "x")
    assert t.drain().failed_recving == {"r1"}


def test_duplicates_and_reports_after_drain_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = LoadTracker()
    t.track("r1", [1])
    t.track("r1", [1])
    t.succeeded("r1")
    t.succeeded("r1")
    t.drain()
    with caplog.at_level(logging.WARNING, logger="kvfail"):
        t.failed("r1", Stage.TRANSFER, "late")
    s = t.stats()
    assert (s["duplicate_tracks"], s["duplicate_reports"], s["late_reports"]) == (1, 1, 1)
    assert "no longer tracked" in caplog.text


@pytest.mark.parametrize("kwargs", [{"num_kv_cache_groups": 0}, {"default_deadline_s": 0}])
def test_bad_construction_is_refused_at_once(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LoadTracker(**kwargs)  # type: ignore[arg-type]
