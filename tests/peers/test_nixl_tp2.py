"""A real NIXL P/D pair at TP 2 (UCX over TCP loopback): P and D each run two TP rank
processes in a real gloo world (``tp_mode="processes"``).

Why: at TP 2 D's rank ``r`` handshakes for and READs P's rank ``r`` (upstream's TP
mapping), P's side channel serves both ranks' metadata from P's scheduler process (as the
engine core does), and the byte pattern is per rank, so a head shard landing on the wrong
rank fails the check. A one-rank fault must be a real one: P's rank 1 SIGKILLed while its
rank 0 serves its half of the pull.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.transports import require_transport

require_transport("nixl")

from kvfail.harness import oracles  # noqa: E402
from kvfail.peers.nixl import NixlPair  # noqa: E402
from kvfail.peers.nixl_exit_guard import install_exit_guard  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[NixlPair]:
    install_exit_guard(request.config)
    p = NixlPair(tp_size=2, build_default_consumer=False)
    try:
        p.consumer("fail", name="tp2-fail")
        yield p
    finally:
        p.close()


def rec_tail(pair: NixlPair) -> str:
    return pair.p.process.output_tail() if pair.p else ""


def test_tp2_pull_moves_every_rank_shard(pair: NixlPair) -> None:
    engine = pair.decoders["tp2-fail"]
    assert [w.remote for w in engine.workers] == [True, True]
    assert len(pair.p.ready["rank_pids"]) == 2
    pair.prefill_and_add("tp2-good", 100, consumer=engine)
    run = pair.run(["tp2-good"], consumer=engine, timeout_s=60.0)
    assert run.ok, (run, pair.records["tp2-good"], rec_tail(pair))
    rec = pair.records["tp2-good"]
    assert not rec.failed
    assert pair.verify("tp2-good"), rec.mismatches
    assert rec.checked_ranks == {0, 1}
    assert pair.handshaked(engine)
    assert not oracles.check_all(engine, ["tp2-good"], failed=False)


def test_tp2_one_rank_killed_fails_the_request(pair: NixlPair) -> None:
    engine = pair.decoders["tp2-fail"]
    params = pair.prefill("tp2-onerank", 100)
    pair.signal_p_rank(1, signal.SIGKILL)
    pair.add("tp2-onerank", params, prompt_len=100, consumer=engine)
    run = pair.run(["tp2-onerank"], consumer=engine, timeout_s=60.0)
    assert run.ok, (run, rec_tail(pair))
    rec = pair.records["tp2-onerank"]
    assert rec.failed, rec
    assert not oracles.check_all(engine, ["tp2-onerank"], failed=True)
    pair.restart_p()
    pair.prefill_and_add("tp2-after", 100, consumer=engine)
    assert pair.run(["tp2-after"], consumer=engine, timeout_s=60.0).ok
    assert pair.verify("tp2-after"), pair.records["tp2-after"].mismatches
