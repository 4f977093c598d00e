"""BlockQuarantine on vLLM's real BlockPool: held blocks stay out of the free pool.

The pool is vLLM's own (``vllm.v1.core.block_pool.BlockPool``), so "out of the free pool"
is what vLLM's allocator sees: a held block is never handed out by ``get_new_blocks``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.v1.core.block_pool import BlockPool

from kvfail.quarantine import BlockQuarantine, QuarantineNotice
from tests.core.fakes import ManualClock

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 16


class Scheduler:
    """What the quarantine sees of vLLM's scheduler: a pool, and each request's blocks."""

    def __init__(self) -> None:
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
        self.requests: dict[str, list[object]] = {}

    def allocate(self, req_id: str, n: int) -> list[int]:
        blocks = self.pool.get_new_blocks(n)
        self.requests[req_id] = blocks
        return [b.block_id for b in blocks]

    def free(self, req_id: str) -> None:
        self.pool.free_blocks(self.requests.pop(req_id))

    def blocks_of(self, req_id: str) -> list[object] | None:
        return self.requests.get(req_id)

    def free_ids(self) -> set[int]:
        return {b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()}


@pytest.fixture
def sched() -> Scheduler:
    return Scheduler()


def _quarantine(sched: Scheduler, cap: int | None = None) -> BlockQuarantine:
    return BlockQuarantine(sched.pool, sched.blocks_of, max_blocks=cap)


def test_held_blocks_never_reach_the_free_pool_until_released(sched: Scheduler) -> None:
    q = _quarantine(sched)
    ids = sched.allocate("r1", 3)
    q.apply(QuarantineNotice(held={("r1", 0)}))
    sched.free("r1")  # what vLLM does with a failed request's blocks
    assert not set(ids) & sched.free_ids()
    # Every other block can be handed out; the held ones never are.
    others = sched.pool.get_new_blocks(sched.pool.get_num_free_blocks())
    assert not set(ids) & {b.block_id for b in others}
    sched.pool.free_blocks(others)
    assert q.blocks_held == 3 and q.is_held("r1")
    q.apply(QuarantineNotice(released={("r1", 0)}))
    assert set(ids) <= sched.free_ids()
    assert q.blocks_held == 0 and len(q) == 0 and (q.holds, q.releases) == (1, 1)


def test_a_request_is_held_until_every_rank_released_it(sched: Scheduler) -> None:
    q = _quarantine(sched)
    ids = sched.allocate("r1", 2)
    q.apply(QuarantineNotice(held={("r1", 0), ("r1", 1)}))
    sched.free("r1")
    q.apply(QuarantineNotice(released={("r1", 1)}))
    assert not set(ids) & sched.free_ids()
    q.apply(QuarantineNotice(held={("r1", 0)}, released={("r1", 0)}))
    assert set(ids) <= sched.free_ids()


def test_hold_and_release_in_one_step_frees_at_once(sched: Scheduler) -> None:
    q = _quarantine(sched)
    ids = sched.allocate("r1", 2)
    q.apply(QuarantineNotice(held={("r1", 0)}, released={("r1", 0)}))
    sched.free("r1")
    assert set(ids) <= sched.free_ids() and q.blocks_held == 0


def test_bad_notices_are_counted_and_touch_nothing(sched: Scheduler) -> None:
    q = _quarantine(sched)
    before = sched.free_ids()
    q.apply(QuarantineNotice(held={("gone", 0)}, released={("never-held", 0)}))
    assert (q.unheld, q.unknown_releases, q.blocks_held) == (1, 1, 0)
    assert sched.free_ids() == before


def test_null_blocks_are_never_held(sched: Scheduler) -> None:
    q = _quarantine(sched)
    sched.requests["r1"] = [sched.pool.null_block, *sched.pool.get_new_blocks(1)]
    q.apply(QuarantineNotice(held={("r1", 0)}))
    assert q.blocks_held == 1


def test_the_cap_says_when_to_stop_taking_remote_loads(sched: Scheduler) -> None:
    q = _quarantine(sched, cap=4)
    sched.allocate("r1", 3)
    q.apply(QuarantineNotice(held={("r1", 0)}))
    assert not q.full()
    sched.allocate("r2", 1)
    q.apply(QuarantineNotice(held={("r2", 0)}))
    assert q.full()
    q.apply(QuarantineNotice(released={("r1", 0)}))
    assert not q.full()
    assert not _quarantine(sched).full()  # no cap: never full


def test_a_hold_covers_every_pipeline_stage_of_d(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D at PP 2, TP 1: both stages hold the load (each stage's P writes its layers).
    vLLM merges every worker's output; with holds keyed by TP rank both stages were
    ``(r, 0)``, and stage 0's release dropped the extra reference while stage 1's P
    could still write. Each stage is named apart by the rank its worker uses."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from kvfail.reporter import FailureReporterMixin
    from kvfail.vllm_quarantine import KvfailWorkerMeta, worker_hold_rank

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    stages = []
    for pp_rank in (0, 1):
        monkeypatch.setattr(
            parallel_state, "get_pp_group", lambda r=pp_rank: SimpleNamespace(rank_in_group=r)
        )
        worker = FailureReporterMixin()
        worker.init_failure_reporter(
            num_kv_cache_groups=1,
            request_level_channel=True,
            quarantine=True,
            rank=worker_hold_rank(config, tp_rank=0),
        )
        stages.append(worker)

    def step() -> None:
        """One engine step: every worker drains; vLLM merges their metadata."""
        metas = []
        for worker in stages:
            worker.drain_step()
            metas.append(KvfailWorkerMeta(notice=worker.take_quarantine_notice()))
        merged = metas[0]
        for meta in metas[1:]:
            merged.aggregate(meta)
        q.apply(merged.notice)

    q = _quarantine(sched)
    ids = sched.allocate("r", 3)
    for worker in stages:
        worker.track_load("r", ids)
        worker.load_failed("r", "transfer", "P may still write", fenced=False)
    step()
    sched.free("r")
    assert q.is_held("r")
    stages[0].load_fenced("r")  # stage 0's P is proven done; stage 1's is not
    step()
    assert q.is_held("r") and not set(ids) & sched.free_ids(), "freed with stage 1 writing"
    stages[1].load_fenced("r")
    step()
    assert not q.is_held("r") and set(ids) <= sched.free_ids()


# ------------------------------------------------------------ holds visible and cheap


def test_the_oldest_hold_and_held_loads_per_p_are_visible(
    sched: Scheduler, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(50.0)
    q = BlockQuarantine(sched.pool, sched.blocks_of, clock=clock)
    assert q.oldest_age_s() == 0.0 and q.loads_by_peer() == {}
    for req_id in ("a", "b", "c"):
        sched.allocate(req_id, 1)
    q.apply(QuarantineNotice(held={("a", 0)}, peers={"a": "p1:1"}))
    clock.now += 10
    q.apply(QuarantineNotice(held={("b", 0), ("c", 0)}, peers={"b": "p1:1"}))
    assert q.loads_by_peer() == {"p1:1": 2, "unknown": 1}
    assert q.oldest_age_s() == 10.0
    with caplog.at_level("WARNING", logger="kvfail.quarantine"):
        assert q.say_overdue(after_s=5.0) == ["a"]  # only the hold past the bound
        assert q.say_overdue(after_s=5.0) == []  # said once
        clock.now += 10
        assert sorted(q.say_overdue(after_s=5.0)) == ["b", "c"]
    named = [r.getMessage() for r in caplog.records if "has held" in r.getMessage()]
    assert len(named) == 3 and "p1:1" in named[0]
    q.apply(QuarantineNotice(released={("a", 0)}))
    assert q.oldest_age_s() == 10.0 and q.loads_by_peer() == {"p1:1": 1, "unknown": 1}


class _Upstream:
    """What QuarantineConnector calls through to: an upstream scheduler half with no
    push work of its own."""

    def has_pending_push_work(self) -> bool:
        return False

    def build_connector_meta(self, scheduler_output: object) -> None:
        return None

    def get_kv_connector_stats(self) -> None:
        return None


def _scheduler_half(q: BlockQuarantine) -> object:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfail.vllm_quarantine import QuarantineConnector

    class Half(QuarantineConnector, _Upstream):
        role = KVConnectorRole.SCHEDULER

    half = Half()
    half._kvfail_quarantine = q
    return half


def test_d_idles_while_only_holds_remain(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """With only holds left, vLLM asks has_pending_push_work around each step and steps
    again at once (a 1 ms pause): a busy loop. Now the first ask after each step pauses,
    and the other asks of the same loop pass through (before: no pause at all)."""
    import kvfail.vllm_quarantine as vq

    pauses: list[float] = []
    monkeypatch.setattr(vq.time, "sleep", pauses.append)
    q = _quarantine(sched)
    half: Any = _scheduler_half(q)
    assert half.has_pending_push_work() is False and pauses == []  # nothing held
    sched.allocate("r", 2)
    q.apply(QuarantineNotice(held={("r", 0)}))
    for step in range(1, 4):
        assert half.has_pending_push_work() is True  # the loop's first ask: a pause
        assert half.has_pending_push_work() is True  # same loop: no second pause
        half.build_connector_meta(object())  # the step
        assert pauses == [vq.HOLD_STEP_S] * step
    q.apply(QuarantineNotice(released={("r", 0)}))
    assert half.has_pending_push_work() is False


def test_stats_carry_the_oldest_hold_and_held_loads_per_p(sched: Scheduler) -> None:
    clock = ManualClock(50.0)
    q = BlockQuarantine(sched.pool, sched.blocks_of, clock=clock)
    half: Any = _scheduler_half(q)
    sched.allocate("r", 2)
    q.apply(QuarantineNotice(held={("r", 0)}, peers={"r": "10.0.0.7:5600"}))
    clock.now += 3
    data = half.get_kv_connector_stats().data
    assert data["kvfail.gauge.oldest_hold_age_seconds"] == 3.0
    assert data["kvfail.gauge.held_loads.10.0.0.7:5600"] == 1
    clock.now += 1  # still held: the age is sent again, though no level changed
    assert half.get_kv_connector_stats().data["kvfail.gauge.oldest_hold_age_seconds"] == 4.0
    q.apply(QuarantineNotice(released={("r", 0)}))
    data = half.get_kv_connector_stats().data
    assert data["kvfail.gauge.held_loads.10.0.0.7:5600"] == 0  # the P left: one 0
    assert data["kvfail.gauge.oldest_hold_age_seconds"] == 0.0
    assert half.get_kv_connector_stats() is None  # nothing held, nothing changed
