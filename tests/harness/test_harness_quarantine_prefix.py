"""A held load after a local prefix hit, under ``recompute``, on vLLM's real Scheduler.

The request keeps a valid local prefix, so a block-level failure alone would let vLLM
keep every block past it and recompute into them, the very block P may still write.
On every vLLM the quarantined load must end with the request's blocks given back and
recomputed into fresh ones: through ``failed_recving`` where it exists, and where it
does not (0.29) through the scheduler half's reset (``_RecordedLoads``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.v1.request import RequestStatus

from kvfail import Stage
from kvfail.harness.requests import prompt_tokens

pytestmark = pytest.mark.vllm

BUDGET = {"max_steps": 60, "timeout_s": 20.0}


def test_a_held_load_after_a_local_hit_recomputes_into_fresh_blocks(make_engine: Any) -> None:
    engine = make_engine(
        engine_id="D-qprefix", policy="recompute", extra_config={"toy_mode": "hold"}
    )
    shared = prompt_tokens("shared", 100, engine.vocab_size)
    engine.add_request("warm", prompt=shared, max_tokens=2)
    engine.run_until_idle(**BUDGET)
    free_before = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # Two cached blocks (64 tokens) are a local hit; the toy loads the third block.
    prompt = shared[:64] + prompt_tokens("tail", 36, engine.vocab_size)
    pd = {"do_remote_prefill": True}
    req = engine.add_request("held", prompt=prompt, max_tokens=2, kv_transfer_params=pd)
    engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (ids,) = engine.scheduler.kv_cache_manager.get_block_ids("held")
    loaded = ids[2]
    worker = engine.workers[0].connector
    assert worker.inflight() == {"held"}

    # P may still write the block: reported now, the block held until fenced.
    assert worker.load_failed("held", Stage.TRANSFER, "read not released", fenced=False)
    quarantine = engine.scheduler.connector.quarantine
    for _ in range(6):
        engine.step()
        if quarantine.is_held("held") and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert quarantine.is_held("held")
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.blocks[loaded].ref_cnt >= 1
    # Until fenced, the request never runs in the held block again.
    for _ in range(BUDGET["max_steps"]):
        (now,) = engine.scheduler.kv_cache_manager.get_block_ids("held")
        assert loaded not in now, f"recompute reused the held block {loaded}: {now}"
        if req.is_finished():
            break
        engine.step()
    assert req.is_finished() and req.status == RequestStatus.FINISHED_LENGTH_CAPPED

    worker.load_fenced("held")
    engine.run_until_idle(**BUDGET)
    engine.step(force=True)  # the release notice rides on a step
    assert not quarantine.is_held("held")
    assert pool.get_num_free_blocks() == free_before
