"""The liveness probe of ``KvfailMooncakeWorker`` against a real P process.

Why real processes: the probe's whole claim rests on what the kernel does for a process
that is gone (its listening socket is closed: connects are refused) versus one that is
only stopped (its socket stays: connects complete). Only a real P, killed or SIGSTOPped
with real signals, tests that. P runs kvfail's connector in its own process (so it has a
writer mark, :mod:`connectors.writer_mark`), or upstream's, which has none
(:class:`kvfail.peers.mooncake.MooncakePair`); D runs ours on the real Scheduler.

One P is shared: the no-false-positive test runs first, the kill test last. No assertion
reads the clock: a kill is checked by its cause (the probe's stage, a report after the
kill). How soon a dead P is failed is ``bench/mooncake_detection.py``'s figure.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from connectors.mooncake import KvfailMooncakeWorker  # noqa: E402
from connectors.mooncake.probe import connect_probe, tcp_endpoint  # noqa: E402
from kvfail import Stage  # noqa: E402
from kvfail.deadline import seconds_from  # noqa: E402
from kvfail.harness import oracles  # noqa: E402
from kvfail.peers.mooncake import MooncakePair  # noqa: E402

pytestmark = pytest.mark.vllm

#: Far above anything measured here, so only the probe can fail a load in these tests.
DEADLINE_S = 60.0
#: How long P stays stopped in the no-false-positive test: many probe intervals, well
#: under the deadline and under P's own expiry (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=5).
STOP_S = 1.5
#: The deadline of the held-blocks test's D, and how long it steps after the load failed:
#: past P's expiry (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=5) counted from that deadline.
HELD_DEADLINE_S = 1.0
HELD_PAST_EXPIRY_S = 6.5
#: The upstream-P pair's max hold: what alone ends a hold no writer mark can prove over.
MAX_HOLD_S = 2.0
#: How long the upstream-P test steps D after the kill to see the blocks still held: a
#: few probe intervals, far below the max hold (a bound set here, never asserted).
UNPROVEN_STEPS_S = 0.5


def _open_pair(p_connector: str | None = None, **extra: object) -> Iterator[MooncakePair]:
    """A pair with kvfail's connector on D (and on P unless ``p_connector``), the probe
    fast and the deadline out of reach; ``extra`` adds to D's extra config."""
    p = MooncakePair(
        policy="fail",
        connector="KvfailMooncakeConnector",
        connector_module="connectors.mooncake",
        p_connector=p_connector,
        extra_config={"kvfail_deadline_s": DEADLINE_S, "kvfail_probe_interval_s": 0.1, **extra},
        abort_request_timeout_s=5,
    )
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[MooncakePair]:
    yield from _open_pair()


@pytest.fixture(scope="module")
def upstream_p_pair() -> Iterator[MooncakePair]:
    """D on kvfail's connector, P on upstream's: no writer mark, and a max hold."""
    yield from _open_pair("MooncakeConnector", kvfail_max_hold_s=MAX_HOLD_S)


def _worker(pair: MooncakePair, consumer: str) -> KvfailMooncakeWorker:
    worker = pair.decoders[consumer].workers[0].connector.connector_worker  # type: ignore[attr-defined]
    assert isinstance(worker, KvfailMooncakeWorker)
    return worker


def _report_step(pair: MooncakePair, consumer: str, req_id: str) -> int | None:
    """The D engine step whose scheduler report first named ``req_id``."""
    reports = pair.decoders[consumer].record.scheduler_reports()
    named = (r.step for r in reports if req_id in r.failed_requests | r.finished_recving)
    return next(named, None)


def _warm(pair: MooncakePair, consumer: str) -> None:
    """One good pull, so D has cached P's side-channel address (the "warm" case)."""
    pair.warm(pair.consumer("fail", name=consumer))


def test_probe_verdicts_on_loopback() -> None:
    """The kernel's two answers the probe relies on, and addresses it must not probe."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert asyncio.run(connect_probe("127.0.0.1", port, 2.0)) == "alive"
    assert asyncio.run(connect_probe("127.0.0.1", port, 2.0)) == "refused"
    assert tcp_endpoint(f"tcp://127.0.0.1:{port}") == ("127.0.0.1", port)
    assert tcp_endpoint("tcp://127.0.0.1:notaport") is None
    assert tcp_endpoint("ipc:///tmp/x") is None


def test_probe_interval_config() -> None:
    key = "kvfail_probe_interval_s"
    assert seconds_from({}, key, 0.2) == 0.2
    assert not seconds_from({key: 0}, key, 0.2)  # 0 and None switch the probe off
    assert seconds_from({key: None}, key, 0.2) is None
    for bad in (-1, "0.2", True):
        with pytest.raises(ValueError):
            seconds_from({key: bad}, key, 0.2)


def test_stopped_then_resumed_p_is_not_failed_by_the_probe(pair: MooncakePair) -> None:
    """SIGSTOP keeps P's listening socket: the probe sees it alive, the pull completes."""
    _warm(pair, "stop")
    worker = _worker(pair, "stop")
    params = pair.prefill("stop-x", 100)
    pair.freeze_p()
    try:
        rec = pair.add("stop-x", params, prompt_len=100, consumer="stop")
        run = pair.run(["stop-x"], consumer="stop", timeout_s=STOP_S)
        assert not run.ok and run.reason == "timeout", run  # still waiting on P
        assert worker._mc_probes, "no probe was running while P was stopped"
        assert rec.reported_s is None and not rec.failed, rec
    finally:
        pair.thaw_p()
    run = pair.run(["stop-x"], consumer="stop", timeout_s=30)
    assert run.ok and not rec.failed and pair.verify("stop-x"), (run, rec)
    assert worker.failure_stats()["loads_failed"] == 0
    assert oracles.check_all(pair.decoders["stop"], failed=False) == []


def test_blocks_stay_held_past_p_expiry_until_a_stopped_p_resumes(pair: MooncakePair) -> None:
    """P is stopped before it reads D's pull; D's deadline fails the load. Mooncake is
    P-push: a resumed P reads the pull and may push into D's blocks then, however long
    it was stopped, so no clock on D (the deadline, P's own expiry) may hand those
    blocks back. They stay held until P's reply proves its push over; the integrity
    oracle then finds no write into a released block."""
    _warm(pair, "held")
    worker = _worker(pair, "held")
    worker.failure_reporter.default_deadline_s = HELD_DEADLINE_S
    engine = pair.decoders["held"]
    pool = engine.scheduler.kv_cache_manager.block_pool
    all_free = engine.spec.num_blocks - 1  # the null block is never free
    params = pair.prefill("held-x", 100)
    pair.freeze_p()
    try:
        rec = pair.add("held-x", params, prompt_len=100, consumer="held")
        run = pair.run(["held-x"], consumer="held", timeout_s=30)
        assert run.ok and rec.failed, (run, rec)  # failed at D's deadline
        _step_for(engine, HELD_PAST_EXPIRY_S)  # D's deadline and P's expiry both passed
        assert pool.get_num_free_blocks() < all_free, "blocks freed while P may still push"
        assert worker._mc_tasks, "the pull was stopped: only P's answer can end the hold"
    finally:
        pair.thaw_p()
    _step_for(engine, 30.0, until=lambda: pool.get_num_free_blocks() == all_free)
    assert oracles.check_all(engine, ["held-x"], failed=True) == []


def _step_for(engine: object, seconds: float, until: Callable[[], bool] | None = None) -> None:
    """Step an engine with no requests (as vLLM does while its connector holds blocks)
    for ``seconds``, or until ``until`` holds."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until is not None and until()):
        engine.step()  # type: ignore[attr-defined]
        time.sleep(0.02)


def test_zz_killed_p_fails_in_flight_and_new_pulls_with_peer_lost(pair: MooncakePair) -> None:
    """Runs last (it kills the shared P). Two warm D engines: one with a pull in flight
    when P dies (P was stopped, so the pull is surely pending), one that starts its pull
    after P died (its DEALER would reconnect to the dead port for 540 s upstream)."""
    _warm(pair, "midpull")
    _warm(pair, "after")
    params = {name: pair.prefill(f"{name}-x", 100) for name in ("midpull", "after")}
    pair.freeze_p()
    pair.add("midpull-x", params["midpull"], prompt_len=100, consumer="midpull")
    run = pair.run(["midpull-x"], consumer="midpull", timeout_s=0.5)
    assert run.reason == "timeout" and not pair.records["midpull-x"].failed, run
    steps_at_kill = {name: pair.decoders[name].record.steps for name in ("midpull", "after")}
    pair.kill_p()
    pair.add("after-x", params["after"], prompt_len=100, consumer="after")
    run = pair.run(consumers=["midpull", "after"], timeout_s=30)
    assert run.ok, run
    for name in ("midpull", "after"):
        rec = pair.records[f"{name}-x"]
        assert rec.failed and rec.reported_s is not None, rec
        # Reported in a step after the kill, and by the probe, not by the deadline.
        step = _report_step(pair, name, f"{name}-x")
        assert step is not None and step >= steps_at_kill[name], (name, step, steps_at_kill)
        stats = _worker(pair, name).failure_stats()
        assert stats.failed_by_stage[Stage.PEER_LOST] == 1, stats
        assert stats.failed_by_stage[Stage.WATCHDOG] == 0, stats
        assert stats["loads_failed"] == 1, stats
        assert oracles.check_all(pair.decoders[name], [f"{name}-x"], failed=True) == []


def test_zz_killed_upstream_p_fails_the_load_but_holds_its_blocks(
    upstream_p_pair: MooncakePair,
) -> None:
    """Upstream's P has no writer mark, and its side channel refusing proves only that
    the channel is closed (a graceful shutdown closes it before P's sender stops). So
    the load is failed by the probe at once, and its blocks stay held until the
    operator's ``kvfail_max_hold_s``; then they come back. Runs last (kills its P)."""
    pair = upstream_p_pair
    _warm(pair, "unproven")
    engine = pair.decoders["unproven"]
    pool = engine.scheduler.kv_cache_manager.block_pool
    all_free = engine.spec.num_blocks - 1  # the null block is never free
    params = pair.prefill("unproven-x", 100)
    pair.freeze_p()
    rec = pair.add("unproven-x", params, prompt_len=100, consumer="unproven")
    run = pair.run(["unproven-x"], consumer="unproven", timeout_s=0.5)
    assert run.reason == "timeout" and not rec.failed, run
    pair.kill_p()
    run = pair.run(["unproven-x"], consumer="unproven", timeout_s=30)
    assert run.ok and rec.failed, (run, rec)
    stats = _worker(pair, "unproven").failure_stats()
    assert stats.failed_by_stage[Stage.PEER_LOST] == 1, stats
    _step_for(engine, UNPROVEN_STEPS_S)
    assert pool.get_num_free_blocks() < all_free, "blocks freed on a refusal alone"
    _step_for(engine, 30.0, until=lambda: pool.get_num_free_blocks() == all_free)
    assert oracles.check_all(engine, ["unproven-x"], failed=True) == []
