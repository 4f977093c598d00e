"""The KV-integrity oracle over a real Mooncake pull (``kvfail.peers.integrity``).

A real P pushes its pattern into D over TCP loopback; D's forward checks and writes every
step. The late writers here are the test itself, writing into D's blocks where a late
transfer would: the oracle must name each write, and stay silent for a clean pull.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.waiting import step_until

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.peers.mooncake import MooncakePair, mooncake_available
from kvfail.peers.pattern import write_pattern

pytestmark = pytest.mark.skipif(
    mooncake_available() is not None, reason=f"Mooncake unavailable: {mooncake_available()}"
)


@pytest.fixture(scope="module")
def pair() -> Iterator[MooncakePair]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = MooncakePair(policy="fail", abort_request_timeout_s=5)
    try:
        yield p
    finally:
        p.close()


def _scribble(pair: MooncakePair, block: int, position_in_block: int) -> None:
    """Overwrite one token slot of ``block`` in every layer of D's rank 0: a late write."""
    engine = pair.d
    assert engine is not None
    for layer, kv in enumerate(engine.workers[0].kv_caches.values()):
        write_pattern(kv, layer, [block], position_in_block, position_in_block + 1, "late")


def _first_scheduled(pair: MooncakePair, rid: str, *, max_tokens: int) -> tuple[Any, list[int]]:
    """Pull ``rid`` and step D until its first schedule after the load (D's forward has
    checked it): D and the request's block ids, before a late writer touches them."""
    engine = pair.d
    assert engine is not None
    rec = pair.prefill_and_add(rid, prompt_len=100, max_tokens=max_tokens)
    step_until(
        pair, engine, lambda: bool(rec.checked_ranks), "the first schedule after the load", 30.0
    )
    (blocks,) = engine.scheduler.kv_cache_manager.get_block_ids(rid)
    return engine, list(blocks)


def test_a_clean_pull_has_no_findings(pair: MooncakePair) -> None:
    rid = "integrity-clean"
    pair.prefill_and_add(rid, prompt_len=100, max_tokens=6)
    assert pair.run([rid], timeout_s=30.0).ok
    assert pair.verify(rid), pair.records[rid].mismatches
    assert pair.integrity_findings(pair.d) == []


def test_a_write_into_a_loaded_position_after_it_ran_is_named(pair: MooncakePair) -> None:
    rid = "integrity-late"
    engine, blocks = _first_scheduled(pair, rid, max_tokens=6)
    assert pair.verify(rid), pair.records[rid].mismatches
    _scribble(pair, blocks[0], 5)  # a loaded position: token 5 of the prompt
    assert pair.run([rid], timeout_s=30.0).ok
    findings = pair.integrity_findings(engine)
    assert any(
        f.startswith(f"C11 wrong KV: {rid}'s positions loaded from P changed") for f in findings
    ), findings


def test_a_write_into_a_released_block_is_named(pair: MooncakePair) -> None:
    rid = "integrity-released"
    engine, blocks = _first_scheduled(pair, rid, max_tokens=2)
    assert pair.run([rid], timeout_s=30.0).ok
    pool = engine.scheduler.kv_cache_manager.block_pool
    free = [b for b in blocks if pool.blocks[b].block_hash is None]
    assert free, "every block stayed in the prefix cache; nothing was poisoned"
    assert [f for f in pair.integrity_findings(engine) if rid in f] == []
    _scribble(pair, free[-1], 0)
    findings = pair.integrity_findings(engine)
    assert any(
        f.startswith(f"C11 write after release: blocks of {rid}") and str(free[-1]) in f
        for f in findings
    ), findings
