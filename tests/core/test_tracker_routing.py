"""Which channel carries a failure to the scheduler: block ids, request id, or none.

One test per routing property of :class:`kvfail.tracker.LoadTracker` (decided in
:mod:`kvfail.tracker_drain`): by the number of KV-cache groups, and by which channels this
vLLM has.
"""

from __future__ import annotations

from kvfail import ALL_PEERS, Stage
from tests.core.trackers import make_tracker

# --------------------------------------------------------------- routing


def test_single_group_routes_blocks_not_request_ids() -> None:
    t = make_tracker(num_kv_cache_groups=1)
    t.track("r1", [[1, 2]])
    t.failed("r1", Stage.PEER, "ERROR response")
    report = t.drain()
    assert report.invalid_block_ids == {1, 2} and not report.failed_recving


def test_several_groups_route_the_request_not_its_blocks() -> None:
    """C5: with HMA, flat block ids are ambiguous and vLLM >= 0.31 raises on them."""
    t = make_tracker(num_kv_cache_groups=2)
    t.track("r1", [[1, 2], [1, 5]])
    t.failed("r1", Stage.PEER, "err_reqs")
    report = t.drain()
    assert report.failed_recving == {"r1"} and report.finished_recving == {"r1"}
    assert not report.invalid_block_ids


def test_flat_and_nested_block_ids_flatten_identically() -> None:
    a, b = make_tracker(), make_tracker()
    a.track("r", [1, 2, 3])
    b.track("r", [[1, 2], [3]])
    for t in (a, b):
        t.failed("r", "transfer", "x")
    assert a.drain().invalid_block_ids == b.drain().invalid_block_ids == {1, 2, 3}


# --------------------------------------------------------------- reporting channels


def test_without_block_level_a_narrowed_failure_goes_by_request_id() -> None:
    """Where block level is gone (vLLM PR #42461), even one lost block fails the whole
    request by id: the scheduler then recomputes it all, never a kept prefix."""
    t = make_tracker(block_level_available=False)
    assert t.request_level
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "block 6 lost", block_ids=[6])
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.failed_recving == {"r1"}
    assert not report.invalid_block_ids and not report.unreportable


def test_without_the_request_channel_a_failure_goes_by_block() -> None:
    t = make_tracker(request_level_available=False)
    t.track("r1", [5, 6, 7])
    t.failed("r1", Stage.TRANSFER, "block 6 lost", block_ids=[6])
    report = t.drain()
    assert report.finished_recving == {"r1"} and report.invalid_block_ids == {6}
    assert not report.failed_recving and not report.unreportable


def test_a_failure_no_channel_can_carry_is_never_delivered_as_finished() -> None:
    """No usable block id and no request channel (vLLM < 0.30): the load is handed back
    as unreportable, outside ``finished_recving`` (the mixin raises on it)."""
    t = make_tracker(request_level_available=False)
    t.track("bad", [-1, "x"])
    t.track("ok", [3])
    t.failed("bad", Stage.PARAMS, "nothing to pull into", peer=ALL_PEERS)
    t.succeeded("ok")
    report = t.drain()
    assert report.unreportable == {"bad"} and report
    assert report.finished_recving == {"ok"}
    assert not report.failed_recving and not report.invalid_block_ids
    assert t.failure_of("bad") is None and len(t) == 0  # delivered to the caller, once
