"""NIXL push mode over a real pair: P WRITEs into a real D engine (vLLM's Scheduler).

Why: in push mode D owns no transfer handle, so failing a load fast is only safe if its
blocks stay held while P may still write. These tests check that on real processes: a
real P (upstream ``NixlPushConnector``, forked from the P zygote) and a D engine with
``KvfailNixlPushConnector`` (3 s deadline), UCX over TCP on 127.0.0.1, faults as signals.

Order matters: the freeze tests thaw P; the kill test (last) ends it. No assertion reads
a time: each is about what D reported, what it holds, and in what order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.transports import require_transport
from tests.waiting import step_until

require_transport("nixl")

from kvfail.harness import Engine, oracles  # noqa: E402
from kvfail.peers.decode_record import DecodeRecord  # noqa: E402
from kvfail.peers.nixl_exit_guard import install_exit_guard  # noqa: E402
from kvfail.peers.nixl_push import (  # noqa: E402
    NixlPushPair,
    late_notifications,
    quarantined,
)
from kvfail.peers.stepping import all_blocks_free  # noqa: E402

pytestmark = pytest.mark.vllm

DEADLINE_S = 3.0
KVFAIL = "kvfail-push"
#: Bound on every wait below (a failure names what was still missing).
WAIT_S = 40.0


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[NixlPushPair]:
    install_exit_guard(request.config)
    p = NixlPushPair(build_default_consumer=False)
    try:
        p.consumer("fail", name=KVFAIL, extra_config={"kvfail_deadline_s": DEADLINE_S})
        # A first verified push: both handshakes (D->P for the registration, P->D for
        # the WRITE) are then done, and out of what the fault tests look at.
        p.warm(KVFAIL, within_s=WAIT_S)
        yield p
    finally:
        p.close()


def _engine(pair: NixlPushPair) -> Engine:
    return pair.decoders[KVFAIL]


def _stats(pair: NixlPushPair) -> dict[str, int]:
    worker = _engine(pair).workers[0].connector.connector_worker
    return dict(worker.failure_stats().as_dict())


@contextlib.contextmanager
def _p_frozen_past_deadline(pair: NixlPushPair, engine: Engine, rid: str) -> Iterator[DecodeRecord]:
    """P prefills ``rid`` and is stopped before it can WRITE; D adds the request and
    reports it at its deadline. Yields D's record; on the way out P is thawed unless the
    body thawed or killed it, as the module's later tests share this P."""
    params = pair.prefill(rid, 100)  # P's blocks are ready; P waits for D's registration
    pair.freeze_p()
    try:
        rec = pair.add(rid, params, prompt_len=100, consumer=engine)
        step_until(
            pair, engine, lambda: rec.reported_s is not None, "the deadline's report", WAIT_S
        )
        yield rec
    finally:
        if pair.p.process.frozen:
            pair.thaw_p()


def test_happy_push_bytes_arrive_exactly(pair: NixlPushPair) -> None:
    rid = "push-happy"
    rec = pair.prefill_and_add(rid, prompt_len=100, consumer=KVFAIL)
    run = pair.run([rid], consumer=KVFAIL, timeout_s=WAIT_S)
    assert run.ok, (run, rec)
    assert pair.verify(rid), rec.mismatches  # every pushed token of every layer is P's
    assert not rec.failed and _engine(pair).status(rid) is not None
    assert _engine(pair).status(rid).name == "FINISHED_LENGTH_CAPPED"
    assert oracles.check_all(_engine(pair), [rid], failed=False) == []
    # P's WRITE completed and P freed its blocks.
    assert pair.wait_finished_sending(_engine(pair), [rid], WAIT_S)
    assert quarantined(_engine(pair)) == {"loads": 0, "blocks": 0}


def test_frozen_p_fails_at_deadline_holds_blocks_until_its_late_write(
    pair: NixlPushPair,
) -> None:
    """P stopped before it could WRITE: D reports at its deadline and holds the blocks;
    thawed, P WRITEs into the held blocks, and only its completion notification (counted
    as late, never passed on) gives them back."""
    engine = _engine(pair)
    before = _stats(pair)
    late_before = late_notifications(engine)
    rid = "push-frozen"
    with _p_frozen_past_deadline(pair, engine, rid) as rec:
        assert rec.failed and engine.status(rid).name == "FINISHED_ERROR", rec
        after = _stats(pair)
        assert after["stage.watchdog"] - before["stage.watchdog"] == 1, (before, after)
        # The registration went out, so a stopped P may still write: held, not freed.
        held = quarantined(engine)
        assert held["loads"] == 1 and held["blocks"] > 0, held
        assert not all_blocks_free(engine)
        for _ in range(50):  # however long P stays stopped, nothing gives the blocks back
            engine.step()
            pair.observe(engine)
        assert quarantined(engine) == held
        pair.thaw_p()
        step_until(
            pair, engine, lambda: quarantined(engine)["loads"] == 0, "the hold's release", WAIT_S
        )
    assert late_notifications(engine) - late_before == 1
    after = _stats(pair)
    assert after["late_reports"] - before["late_reports"] >= 1, (before, after)
    assert after["loads_failed"] - before["loads_failed"] == 1, (before, after)
    assert pair.wait_finished_sending(engine, [rid], WAIT_S)  # the late WRITE really happened
    step_until(
        pair, engine, lambda: all_blocks_free(engine), "every block back in the pool", WAIT_S
    )
    # No byte of another request changed, and nothing wrote into a freed block.
    assert pair.integrity_findings(engine) == []
    assert oracles.check_all(engine, [rid], failed=True) == []
    # D still serves pushes afterwards.
    ok = "push-after-thaw"
    pair.prefill_and_add(ok, prompt_len=60, consumer=KVFAIL)
    run = pair.run([ok], consumer=KVFAIL, timeout_s=WAIT_S)
    assert run.ok and pair.verify(ok), (run, pair.records[ok])


def test_control_freeing_at_the_deadline_is_flagged(pair: NixlPushPair) -> None:
    """Negative control: the same frozen P, on a D whose fence says "over" at once (fail
    fast, free at once, as without a hold). The late WRITE then lands in blocks the
    scheduler freed, and the integrity oracle must name it: the oracle the tests above
    rely on can fail."""
    control = pair.consumer("fail", name="control", extra_config={"kvfail_deadline_s": DEADLINE_S})
    pair.warm(control, within_s=WAIT_S)
    worker = control.workers[0].connector.connector_worker
    worker.failure_reporter._fence = lambda req_id: True  # no hold: blocks back at once
    rid = "push-control"
    with _p_frozen_past_deadline(pair, control, rid) as rec:
        assert rec.failed and quarantined(control)["loads"] == 0
    # P's WRITE into the freed blocks completed.
    assert pair.wait_finished_sending(control, [rid], WAIT_S)
    findings = pair.integrity_findings(control)
    assert any("write after release" in f and rid in f for f in findings), findings
    control.close()
    pair.decoders.pop("control", None)


def test_push_from_a_wider_p_lands_exact_bytes() -> None:
    """P at TP 2 WRITEs into a D at TP 1: upstream's push worker maps P's head shards
    onto D's rank by the TP ratio, and D ends each load once every producing rank has
    notified. The byte oracle checks every head of every block. (The conformance suite
    runs this shape too, ``--connector nixl-push --layout p2d1``; this keeps it in the
    default run.)"""
    hetero = NixlPushPair(tp_size=1, p_tp_size=2, build_default_consumer=False)
    try:
        engine = hetero.consumer("fail", name=KVFAIL, extra_config={"kvfail_deadline_s": 8.0})
        hetero.warm(KVFAIL, within_s=WAIT_S)
        rids = [f"push-p2d1-{i}" for i in range(3)]
        for rid in rids:
            hetero.prefill_and_add(rid, 100, consumer=engine)
        assert hetero.run(rids, consumer=engine, timeout_s=WAIT_S).ok
        assert [hetero.records[r].failed for r in rids] == [False] * 3
        assert all(hetero.verify(r) for r in rids)
        assert hetero.integrity_findings(engine) == []
    finally:
        hetero.close()


def test_killed_p_blocks_come_back_once_p_is_known_dead(pair: NixlPushPair) -> None:
    """P stopped (so its WRITE cannot happen first), D fails the load and holds it; P is
    then SIGKILLed: its side channel refuses connections and the blocks come back."""
    engine = _engine(pair)
    late_before = late_notifications(engine)
    rid = "push-killed"
    with _p_frozen_past_deadline(pair, engine, rid) as rec:
        assert rec.failed and quarantined(engine)["loads"] == 1
        pair.kill_p()
    step_until(
        pair, engine, lambda: quarantined(engine)["loads"] == 0, "release once P is dead", WAIT_S
    )
    assert late_notifications(engine) == late_before  # no write: P died stopped
    step_until(
        pair, engine, lambda: all_blocks_free(engine), "every block back in the pool", WAIT_S
    )
    assert pair.integrity_findings(engine) == []
    assert oracles.check_all(engine, [rid], failed=True) == []
