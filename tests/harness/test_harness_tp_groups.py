"""The harness with two simulated TP ranks, with two KV-cache groups, and P -> D bytes.

TP=2 runs two WORKER-role connector instances in this process and merges their outputs
with vLLM's own ``KVOutputAggregator`` (see ``kvfail/harness/engine.py`` for the limits).
Two groups: what the real 0.32.0 scheduler does, as contract clause C5 describes: a
block-level report raises ``RuntimeError``; the request-level channel works.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import torch
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvfail.harness import oracles

pytestmark = pytest.mark.vllm

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 40, "timeout_s": 10.0}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_tp2_failure_on_one_rank_only(make_engine: Any, policy: str) -> None:
    engine = make_engine(
        engine_id=f"D-tp2-{policy}", tp_size=2, policy=policy, extra_config={"toy_mode": "hold"}
    )
    assert engine.aggregator is not None
    req = engine.add_request("r", kv_transfer_params=PD)
    engine.step()
    rank0, rank1 = (w.connector for w in engine.workers)
    assert rank0.inflight() == rank1.inflight() == {"r"}
    assert engine.workers[0].kv_caches is not engine.workers[1].kv_caches

    rank0.complete("r")
    engine.step()
    # One rank's completion is not the request's completion: the aggregator waits (C11).
    assert [r.rank for r in engine.record.kv_reports] == [0]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    rank1.fail("r", block_index=0)
    engine.step()
    seen = engine.record.scheduler_reports()
    assert len(seen) == 1
    assert seen[0].finished_recving == {"r"} and seen[0].failed_requests == {"r"}
    assert seen[0].invalid_block_ids == set(engine.record.rank_reports(1)[0].invalid_block_ids)
    assert engine.run_until_idle(**BUDGET).ok
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
    else:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert oracles.check_all(engine, failed=True) == []


def test_two_groups_success_allocates_in_both_groups(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-g2-ok", num_kv_cache_groups=2)
    assert [len(g.layer_names) for g in engine.kv_cache_config.kv_cache_groups] == [1, 1]
    assert type(engine.scheduler.kv_cache_manager.coordinator).__name__ == (
        "HybridKVCacheCoordinator"
    )
    engine.add_request("g", kv_transfer_params=PD, max_tokens=2)
    engine.step()
    groups = engine.scheduler.kv_cache_manager.get_block_ids("g")
    # Only the 96 advertised tokens (3 blocks) are allocated while the load is in flight,
    # in each group, from one shared pool, so the ids are disjoint.
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    assert not set(groups[0]) & set(groups[1])
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_all(engine) == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_two_groups_request_level_failure_follows_policy(make_engine: Any, policy: str) -> None:
    engine = make_engine(
        engine_id=f"D-g2-{policy}",
        num_kv_cache_groups=2,
        policy=policy,
        extra_config={"toy_mode": "hold"},
    )
    req = engine.add_request("g", kv_transfer_params=PD, max_tokens=2)
    engine.step()
    engine.workers[0].connector.fail("g")
    engine.step()
    seen = engine.record.scheduler_reports()[-1]
    # The reporter routes by group count: request id, no block ids (C5), paired (C6).
    assert seen.failed_recving == {"g"} and seen.finished_recving == {"g"}
    assert not seen.invalid_block_ids
    if policy == "recompute":
        assert req.num_computed_tokens == 0
    assert engine.run_until_idle(**BUDGET).ok
    expected = (
        RequestStatus.FINISHED_ERROR if policy == "fail" else (RequestStatus.FINISHED_LENGTH_CAPPED)
    )
    assert req.status == expected
    assert oracles.check_all(engine, failed=True) == []


def test_two_groups_block_level_report_raises_runtime_error_c5(make_engine: Any) -> None:
    engine = make_engine(
        engine_id="D-g2-c5", num_kv_cache_groups=2, extra_config={"toy_mode": "hold"}
    )
    engine.add_request("g", kv_transfer_params=PD)
    engine.step()
    block = engine.scheduler.kv_cache_manager.get_block_ids("g")[1][0]
    connector = engine.workers[0].connector
    connector.inject(finished_recving={"g"}, invalid_block_ids={block})
    step = engine.step()
    assert step.crash is not None and step.crash.exc_type == "RuntimeError"
    assert step.crash.clause == "C5" and "failed_recving" in step.crash.message
    assert oracles.check_no_crash(engine)[0].startswith("C5 crash")


def _pattern(layer: int, position: int) -> float:
    return float(layer * 16 + position + 1)


def _write_pattern(engine: Any, worker: Any, so: Any) -> None:
    """Producer 'forward': fill each scheduled request's blocks with a known value."""
    manager = engine.scheduler.kv_cache_manager
    for req_id in so.num_scheduled_tokens:
        (blocks,) = manager.get_block_ids(req_id)
        for li, name in enumerate(engine.built.layer_names):
            for pos, block in enumerate(blocks):
                worker.kv_caches[name][block].fill_(_pattern(li, pos))


def test_producer_to_consumer_bytes_through_the_toy_transport(make_engine: Any) -> None:
    from kvfail.harness.toy import TRANSPORT

    producer = make_engine(role="producer", engine_id="P-bytes", forward=_write_pattern)
    consumer = make_engine(engine_id="D-bytes")
    producer.add_request(
        "p",
        prompt_len=100,
        prompt_seed="shared",
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    assert producer.run_until_idle(**BUDGET).ok
    (done,) = [o for o in producer.record.outputs if o.finish_reason is not None]
    assert done.finish_reason == FinishReason.LENGTH
    params = dict(done.kv_transfer_params or {})
    assert params["remote_engine_id"] == "P-bytes" and len(params["remote_block_ids"]) == 1
    assert ("P-bytes", "p") in TRANSPORT._data
    assert [r.finished_sending for r in producer.record.scheduler_reports()] == [{"p"}]
    assert oracles.check_all(producer) == []

    req = consumer.add_request(
        "d", prompt_len=100, prompt_seed="shared", max_tokens=2, kv_transfer_params=params
    )
    assert req.prompt_token_ids == producer.requests["p"].prompt_token_ids
    consumer.step()
    (d_blocks,) = consumer.scheduler.kv_cache_manager.get_block_ids("d")
    loaded = d_blocks[:3]  # 96 tokens advertised = 3 whole blocks
    for li, name in enumerate(consumer.built.layer_names):
        cache = consumer.workers[0].kv_caches[name]
        for pos, block in enumerate(loaded):
            assert torch.equal(cache[block], torch.full_like(cache[block], _pattern(li, pos)))
    assert consumer.run_until_idle(**BUDGET).ok
    assert oracles.check_all(consumer) == []
