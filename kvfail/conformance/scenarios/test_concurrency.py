"""Concurrency scenarios: many loads in flight at once, failing together.

Why: every other scenario has one load in flight, so a connector that keeps one failure
slot per step, or fails only the first request of a batch when a peer dies, passes them
all while it strands every other request forever (the scheduler has no timeout). Here
``MANY`` requests from the same P load at once, and the fault hits several of them in
the same step: a dead P, an error for each, some failing while others succeed, failures
racing aborts; and one D loads from two P's at once when one of them dies, so a
connector must tell a dead peer's loads from a live one's. Each scenario ends with every
oracle over ALL its requests. Requirements are capabilities and fault points, never
connector names; the suite bounds every wait.

On a real transport the suite cannot pick the step a failure lands in: the loads are
started in one step (one batched pull where the transport batches) and the step counts
of the failures are noted in the report (``failure_steps``), never asserted.

The last scenarios put time into it: a frozen P that only D's declared deadline can end
for all ``MANY`` loads at once, and a slow but live P whose loads that deadline must NOT
end. The seeded soak, many such batches through one long-lived D, is
``test_concurrency_soak.py``; the batch helpers both use are in
:mod:`kvfail.conformance.many_loads`.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.many_loads import (
    PROMPT_LEN,
    failed_at,
    not_late,
    note_failure_steps,
    reports_after_free,
    start_loads,
    wrong_bytes,
)
from kvfail.conformance.report_timing import deadline_findings, declared_text
from kvfail.conformance.suite import ScenarioContext
from kvfail.faults.points import FaultPoint
from kvfail.harness import oracles

pytestmark = pytest.mark.vllm

#: Loads in flight at once, all from the same P.
MANY = 8
#: Faults that fail every load they are armed for promptly, preferred order.
ALL_FAIL = (
    FaultPoint.PEER_ERROR_RESPONSE,
    FaultPoint.PEER_ERR_REQS,
    FaultPoint.UNKNOWN_ENGINE,
    FaultPoint.REFUSE,
)
#: Faults that fail only the request they are armed for, leaving the rest of the same
#: pull alone. An error reply answers a whole pull on a transport that batches them, so
#: it comes last: it is used only where nothing narrower is advertised (the toy's is
#: per request).
ONE_OF_MANY = (
    FaultPoint.PEER_ERR_REQS,
    FaultPoint.UNKNOWN_ENGINE,
    FaultPoint.PEER_ERROR_RESPONSE,
)
#: On a real transport, how long D is not stepped between provoking the failures and the
#: second half of the aborts, so the failures (already on their way) reach the connector
#: first. A bound set here, never asserted.
RACE_SETTLE_S = 0.5
#: Steps a slow peer's load must have waited: fewer, and the delay did not hold it, so a
#: connector that fails loads after one step would pass (the scenario proves nothing).
MIN_DELAY_STEPS = 2


def _rids(scenario: ScenarioContext, stem: str, n: int = MANY) -> list[str]:
    return [scenario.rid(stem) for _ in range(n)]


def _fault_all(
    scenario: ScenarioContext, engine: Any, point: FaultPoint, stem: str
) -> tuple[list[str], dict[str, list[int]]]:
    """``MANY`` loads from one P started together, ``point`` armed and provoked for each;
    returns the ids and each load's blocks (as :func:`_fault_one_rank` for one rank)."""
    rids = _rids(scenario, stem)
    scenario.driver.add_remote_requests(engine, rids, fault=point, prompt_len=PROMPT_LEN)
    blocks = start_loads(scenario, engine, rids)
    for rid in rids:
        scenario.driver.provoke(engine, rid, point)
    return rids, blocks


def _run_mixed(
    scenario: ScenarioContext,
    engine: Any,
    point: FaultPoint,
    rids: list[str],
    bad: list[str],
    good: list[str],
) -> dict[str, list[int]]:
    """Start the added loads of ``rids`` together, provoke ``point`` for each of ``bad``
    and let P serve each of ``good``, then run D to the end; returns each load's blocks.
    For the scenarios where failures and successes share a batch."""
    blocks = start_loads(scenario, engine, rids)
    for rid in bad:
        scenario.driver.provoke(engine, rid, point)
    for rid in good:
        scenario.driver.settle(engine, rid)
    scenario.run(engine)
    note_failure_steps(scenario, engine, bad)
    return blocks


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C9")
@pytest.mark.guards("#50719", "#55870")
def test_many_loads_fail_in_one_step(scenario: ScenarioContext) -> None:
    """``MANY`` loads from one P, each failed by the first fault of ``ALL_FAIL`` the
    driver has (a real P's error reply to the batched pull, params naming an unknown
    engine; the toy fails them all before one step, so one drain carries every failure).
    Every one is reported failed, exactly once, paired with finished_recving, and ends as
    the policy says; none is lost behind the first failure of the step; nothing leaks."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(*ALL_FAIL)
    engine = scenario.engine()
    rids, blocks = _fault_all(scenario, engine, point, "fail-many")
    scenario.run(engine)
    note_failure_steps(scenario, engine, rids)
    extra = [*wrong_bytes(scenario, engine, rids), *not_late(engine, blocks)]
    scenario.check(engine, rids, failed=True, extra=extra)


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C11")
@pytest.mark.guards("#50719", "#55870", "HF3FS")
def test_failures_and_successes_same_step(scenario: ScenarioContext) -> None:
    """``MANY`` loads from one P started together; every other one fails (a fault that
    names one request: P's reply names the failed ones and serves the rest of the same
    pull, or one request's params name an unknown engine), the others succeed, in the
    same step where the driver can choose (the toy). Failures are reported failed and end
    as the policy says; successes are successes: never reported failed, and
    (``byte_verification``) run on P's bytes."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(*ONE_OF_MANY)
    engine = scenario.engine()
    rids = _rids(scenario, "mixed")
    bad, good = rids[::2], rids[1::2]
    for rid in rids:  # interleaved, all added before D steps: one batch
        fault = point if rid in bad else None
        scenario.driver.add_remote_requests(engine, [rid], fault=fault, prompt_len=PROMPT_LEN)
    blocks = _run_mixed(scenario, engine, point, rids, bad, good)
    extra = [*wrong_bytes(scenario, engine, bad), *not_late(engine, blocks)]
    falsely = failed_at(engine, good)
    extra += [
        f"C8 false failure: {rid} loaded well but a failure reached the scheduler at "
        f"step(s) {steps}"
        for rid, steps in falsely.items()
    ]
    if scenario.caps.byte_verification:
        for rid in good:
            mismatch = scenario.driver.verify_bytes(engine, rid)
            if mismatch:
                extra.append(f"C1 wrong bytes for a successful load next to failures: {mismatch}")
    extra += scenario.violations(engine, good, failed=False)
    scenario.check(engine, bad, failed=True, extra=extra)


@pytest.mark.clauses("C7", "C8", "C9", "C10")
@pytest.mark.guards("#32255", "#56089", "#46240", "vllm-ascend#7878")
def test_failure_races_abort(scenario: ScenarioContext) -> None:
    """``MANY`` loads from one P, all to fail; half are aborted before their failure is
    provoked, half after it (the toy: both orders before one step; a real transport: the
    second half once the failures had time to reach D). Each request's blocks are held
    until its finished_recving and then all freed, it is reported exactly once, never
    after the scheduler freed it (C7, watched through the next request D serves), and no
    aborted request produces a token."""
    scenario.require("remote_prefill", "async_load")
    scenario.require_fault(FaultPoint.ABORT_WHILE_WAITING)
    point = scenario.require_fault(*ALL_FAIL)
    engine = scenario.engine()
    rids = _rids(scenario, "race")
    abort_first, fail_first = rids[::2], rids[1::2]
    scenario.driver.add_remote_requests(engine, rids, fault=point, prompt_len=PROMPT_LEN)
    blocks = start_loads(scenario, engine, rids)
    for rid in abort_first:
        scenario.driver.provoke(engine, rid, FaultPoint.ABORT_WHILE_WAITING)
    for rid in rids:
        scenario.driver.provoke(engine, rid, point)
    if scenario.driver.poll_s:
        time.sleep(RACE_SETTLE_S)
    for rid in fail_first:
        scenario.driver.provoke(engine, rid, FaultPoint.ABORT_WHILE_WAITING)
    scenario.run(engine)
    scenario.next_traffic(engine)
    found = scenario.violations(engine, rids, failed=None, policy_outcome=False)
    found += not_late(engine, blocks)
    for rid in rids:
        found += reports_after_free(engine, rid)
        tokens = [t for o in engine.record.outputs_for(rid) for t in o.new_token_ids]
        if tokens:
            found.append(f"C9: aborted {rid} generated {len(tokens)} tokens")
    scenario.assert_clean(found)


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C9", "C10")
@pytest.mark.guards("#50719", "#26171")
def test_many_loads_peer_killed(scenario: ScenarioContext) -> None:
    """``MANY`` loads in flight from one P when it is SIGKILLed (after it prefilled them
    all, before a cold D pulled): one event fails every load. Each is reported failed
    exactly once, paired with finished_recving, and ends as the policy says; none is
    stranded because the connector reported only the first failure of the peer."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.KILL_BEFORE_PULL)
    engine = scenario.engine()
    rids, blocks = _fault_all(scenario, engine, point, "killed-many")
    scenario.run(engine)
    note_failure_steps(scenario, engine, rids)
    scenario.check(engine, rids, failed=True, extra=not_late(engine, blocks))


def _judge_by_deadline(
    scenario: ScenarioContext,
    engine: Any,
    rids: list[str],
    blocks: dict[str, list[int]],
    deadline: float | None,
) -> None:
    """Step D through loads only its deadline can end (nothing answers them), within the
    suite's bounded wait, and judge them: each failed once, by the declared deadline (+ a
    margin), nothing stranded, late or written after its release."""
    budget = scenario.deadline_budget(deadline)
    scenario.wait_floor(budget if deadline is None else deadline)  # only the deadline ends it
    scenario.run(engine, timeout_s=budget)
    note_failure_steps(scenario, engine, rids)
    extra = [*wrong_bytes(scenario, engine, rids), *not_late(engine, blocks)]
    stranded = [rid for rid in rids if rid in engine.waiting_for_remote()]
    times = [t for t in (scenario.driver.detection_s(engine, rid) for rid in rids) if t is not None]
    if times:
        scenario.note("detected_s", round(max(times), 3))
    extra += deadline_findings(rids, stranded, times, deadline, budget)
    scenario.check(engine, rids, failed=True, extra=extra)


#: The P rank the many-loads one-rank scenarios kill or stop: not rank 0, the rank a connector
#: that reads only its first worker's view sees (single loads fault each rank in turn).
ONE_RANK = 1


def _require_one_rank(scenario: ScenarioContext, point: FaultPoint) -> None:
    """Skip unless the driver can fault P's rank ``ONE_RANK`` alone with ``point``, in a
    layout where P has two ranks: P's rank r serves D's rank r (the TP 2 ones), or D's
    one rank reads from both (``p2d1``: every load then touches the faulted rank)."""
    scenario.require("remote_prefill", "async_load", "tp2")
    scenario.require_layout("tp2", "tp2-g2", "p2d1", "p2d1-g2")
    scenario.require_fault_on_rank(ONE_RANK, point)


def _fault_one_rank(
    scenario: ScenarioContext, engine: Any, point: FaultPoint, tag: str
) -> tuple[list[str], dict[str, list[int]]]:
    """``MANY`` loads started together, each with ``point`` on P's rank ``ONE_RANK`` and
    its other ranks settled; returns the ids and each load's blocks."""
    rids = _rids(scenario, tag)
    # D's ranks that load from a live P rank alone: none where D's one rank reads from
    # every P rank (p2d1).
    hetero = scenario.layout.heterogeneous
    others = [] if hetero else [r for r in range(scenario.layout.tp_size) if r != ONE_RANK]
    scenario.driver.add_remote_requests(
        engine, rids, fault=point, prompt_len=PROMPT_LEN, ranks=[ONE_RANK]
    )
    blocks = start_loads(scenario, engine, rids)
    for rid in rids:
        scenario.driver.provoke(engine, rid, point, ranks=[ONE_RANK])
        scenario.driver.settle(engine, rid, ranks=others)
    return rids, blocks


@pytest.mark.clauses("C1", "C2", "C3", "C6", "C8", "C10", "C11")
@pytest.mark.guards("#42422", "#50719")
def test_many_loads_one_rank_killed(scenario: ScenarioContext) -> None:
    """TP=2: ``MANY`` loads in flight from one P when its rank ``ONE_RANK`` is SIGKILLed
    (after it prefilled them all, before D pulled; the toy fails that rank's load of
    each) while its other rank lives and serves its shard of every load. Every load
    touched the dead rank (at TP 2 each load is sharded over both), so each is reported
    failed exactly once through vLLM's KVOutputAggregator, paired with finished_recving,
    and ends as the policy says; none is stranded because the connector gave up on the
    rank after its first failure; no request runs on KV that is not P's, and nothing
    writes into a block after its release (the integrity oracle's watch)."""
    _require_one_rank(scenario, FaultPoint.TP_ONE_RANK)
    engine = scenario.engine()
    rids, blocks = _fault_one_rank(scenario, engine, FaultPoint.TP_ONE_RANK, "rank-killed-many")
    scenario.run(engine)
    note_failure_steps(scenario, engine, rids)
    extra = [*wrong_bytes(scenario, engine, rids), *not_late(engine, blocks)]
    scenario.check(engine, rids, failed=True, extra=extra)


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C10", "C11")
@pytest.mark.guards("#42422", "#35943")
def test_many_loads_one_rank_frozen(scenario: ScenarioContext) -> None:
    """TP=2: ``MANY`` loads in flight from one P when its rank ``ONE_RANK`` is SIGSTOPped
    (after it prefilled them all) while its other rank serves its shard of every load.
    The stopped rank's sockets stay open and nothing answers, so only D's deadline can
    end its share: every load must be reported failed by the declared deadline (+ a
    margin), exactly once, through vLLM's KVOutputAggregator. The stopped rank may write
    when it goes on, so no block may be released while it could (the integrity oracle's
    watch, until the suite lets the rank continue and D gives the blocks back)."""
    _require_one_rank(scenario, FaultPoint.TP_ONE_RANK_FROZEN)
    engine = scenario.engine(deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    rids, blocks = _fault_one_rank(
        scenario, engine, FaultPoint.TP_ONE_RANK_FROZEN, "rank-frozen-many"
    )
    _judge_by_deadline(scenario, engine, rids, blocks, deadline)


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C10", "C11")
@pytest.mark.guards("#50719", "#26171")
def test_two_peers_one_killed(scenario: ScenarioContext) -> None:
    """One D with loads in flight from TWO P processes at once, ``MANY // 2`` from each;
    one P is SIGKILLed (after it prefilled its share, before D pulled) while the other
    lives and serves its own. Every load from the dead P is reported failed exactly once,
    paired with finished_recving in the same pass, and ends as the policy says; every load
    from the live P succeeds on P's bytes (``byte_verification``) and is never reported
    failed (C8). A connector that fails every peer's loads when one peer dies, or loses
    track of one peer's failures, breaks here; nothing may be stranded or leak, and every
    oracle holds over all requests."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.KILL_ONE_PEER)
    engine = scenario.engine()
    live = _rids(scenario, "two-p-live", MANY // 2)
    dead = _rids(scenario, "two-p-killed", MANY // 2)
    rids = [*live, *dead]
    # The second P's share first: starting that P takes seconds, and a real P holds what
    # it prefilled only for a bounded time, so the live P prefills last, right before D
    # pulls. Both shares are then in flight in D together.
    scenario.driver.add_remote_requests(engine, dead, fault=point, prompt_len=PROMPT_LEN, peer=1)
    scenario.driver.add_remote_requests(engine, live, prompt_len=PROMPT_LEN)
    blocks = _run_mixed(scenario, engine, point, rids, dead, live)
    # The live P's false failures first: its loads' policy outcomes follow from them.
    found = [
        f"C8 false failure: {rid} loaded from the live P, but a failure reached the "
        f"scheduler at step(s) {steps}"
        for rid, steps in sorted(failed_at(engine, live).items())
    ]
    if scenario.caps.byte_verification and engine.crashed is None:  # a dead D ran nothing
        for rid in live:
            mismatch = scenario.driver.verify_bytes(engine, rid)
            if mismatch:
                found.append(f"C1 wrong bytes for a load from the live P: {mismatch}")
    found += [*wrong_bytes(scenario, engine, dead), *not_late(engine, blocks)]
    found += scenario.violations(engine, rids, failed=None, policy_outcome=False)
    if engine.crashed is None:
        for rid in live:
            found += oracles.check_policy_outcome(engine, rid, failed=False)
        for rid in dead:
            found += oracles.check_policy_outcome(engine, rid, failed=True)
    scenario.assert_clean(found)


@pytest.mark.clauses("C1", "C2", "C3", "C8", "C10", "C11")
@pytest.mark.guards("#35943", "#50754")
def test_many_loads_peer_frozen(scenario: ScenarioContext) -> None:
    """``MANY`` loads in flight from one P when it is SIGSTOPped (after it prefilled them
    all): its sockets stay open and nothing answers, so only D's own deadline can end
    them, and it must end every one, not only the first it notices. Each is reported
    failed by the deadline the connector declares (+ a margin), exactly once, paired with
    finished_recving, and ends as the policy says; nothing leaks. The suite's wait is
    bounded as for one frozen load; the failures' step counts are noted, never asserted."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.FREEZE_PEER)
    engine = scenario.engine(deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    rids, blocks = _fault_all(scenario, engine, point, "frozen-many")
    _judge_by_deadline(scenario, engine, rids, blocks, deadline)


def _failed_early(
    scenario: ScenarioContext, engine: Any, rids: list[str], deadline: float | None
) -> list[str]:
    """C10: a load reported failed while its peer was alive and answering late, before
    the deadline its connector declares (or at all, if it declares none): a deadline
    bounds a silent peer, it is no licence to fail a slow one. A failure after the
    declared deadline is still a false failure here (the answer was due well before)."""
    out = []
    for rid, steps in sorted(failed_at(engine, rids).items()):
        seconds = scenario.driver.detection_s(engine, rid)
        when = "" if seconds is None else f", {seconds:.2f} s after it was added"
        if deadline is None or seconds is None or seconds < deadline:
            out.append(
                f"C10 early failure: {rid} reported failed at step {steps[0]}{when}, its "
                f"peer alive and answering late; the connector {declared_text(deadline)}"
            )
        else:
            out.append(
                f"C8 false failure: {rid} of a slow but live peer reported failed at step "
                f"{steps[0]}{when}; the connector {declared_text(deadline)}"
            )
    return out


def _waited_steps(engine: Any, rid: str) -> int:
    return sum(rid in waiting for waiting in engine.record.waiting_for_remote)


@pytest.mark.clauses("C1", "C8", "C10", "C11")
@pytest.mark.guards("#35943", "#50754")
def test_slow_peer_not_failed_before_deadline(scenario: ScenarioContext) -> None:
    """``MANY`` loads from one slow but ALIVE P (``net_delay``: its answer comes after
    several D steps, well below the deadline D's connector declares). D cannot tell it
    from a frozen P until its deadline, and must not guess: no load may be failed early
    (C10), every one succeeds on P's bytes (``byte_verification``) and ends as a success.
    D loads once first (warm), so only the peer's delay is timed. Each must have waited
    at least ``MIN_DELAY_STEPS`` steps, or the delay held nothing."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.NET_DELAY)
    engine = scenario.engine(deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    # Warm: a cold D's own set-up (bootstrap, first connection) is not the peer's delay.
    scenario.warm_up(engine)
    rids = _rids(scenario, "slow")
    scenario.driver.add_remote_requests(engine, rids, fault=point, prompt_len=PROMPT_LEN)
    blocks = start_loads(scenario, engine, rids)
    scenario.wait_floor(getattr(scenario.driver, "NET_DELAY_S", 0.0))  # P's own delay
    scenario.run(engine, timeout_s=scenario.deadline_budget(deadline))
    failed = failed_at(engine, rids)
    extra = [*_failed_early(scenario, engine, rids, deadline), *not_late(engine, blocks)]
    waited = {rid: _waited_steps(engine, rid) for rid in rids}
    scenario.note("waited_steps", min(waited.values()))
    times = [t for t in (scenario.driver.detection_s(engine, rid) for rid in rids) if t is not None]
    if times:
        scenario.note("answered_s", round(max(times), 3))
    short = sorted(rid for rid, n in waited.items() if n < MIN_DELAY_STEPS and rid not in failed)
    if short:
        extra.append(
            f"C10 setup: net_delay did not hold {short}: they waited fewer than "
            f"{MIN_DELAY_STEPS} steps, so an early failure could not show"
        )
    if scenario.caps.byte_verification:
        for rid in rids:
            mismatch = None if rid in failed else scenario.driver.verify_bytes(engine, rid)
            if mismatch:
                extra.append(f"C1 wrong bytes for a slow peer's load: {mismatch}")
    # The early failures first: the policy outcome of a failed load follows from them.
    scenario.assert_clean([*extra, *scenario.violations(engine, rids, failed=False)])
