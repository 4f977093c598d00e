"""The conformance scenarios: run against any connector with ``--connector X``.

Each scenario tells one failure story, cites the contract clauses it exercises
(``@clauses``) and the upstream issues it guards (``@guards``), and ends with every
harness oracle: no crash, liveness, no leaks, exactly once, no re-advertised hit, and the
policy outcome (``fail``: FINISHED_ERROR with FinishReason.ERROR; ``recompute``:
completes). Requirements are
capabilities, never connector names; the suite bounds every wait itself.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.report_timing import check_not_late, deadline_findings
from kvfail.conformance.suite import ScenarioContext
from kvfail.faults.points import FaultPoint

# The clauses each scenario cites (@pytest.mark.clauses) are defined in docs/contract.md.
pytestmark = pytest.mark.vllm

#: Faults a connector notices promptly, preferred order (the toy can only do the first).
ACTIVE = (
    FaultPoint.PEER_ERROR_RESPONSE,
    FaultPoint.KILL_DURING_TRANSFER,
    FaultPoint.KILL_BEFORE_PULL,
    FaultPoint.REFUSE,
    FaultPoint.UNKNOWN_ENGINE,
)

#: Faults only the connector's own deadline can end; the generic silent scenario takes
#: the first (the others have their own scenarios).
SILENT = (
    FaultPoint.NET_BLACKHOLE,
    FaultPoint.FREEZE_PEER,
    FaultPoint.PEER_FINISH_WITHOUT_RESULT,
)


def _reports_naming(engine: Any, request_id: str) -> list[str]:
    """Every report (rank or scheduler view) that names ``request_id``."""
    found = []
    for r in engine.record.kv_reports:
        for attr in ("finished_recving", "failed_recving", "finished_sending"):
            if request_id in getattr(r, attr):
                who = "scheduler" if r.rank is None else f"worker[{r.rank}]"
                found.append(f"{who} {attr} at step {r.step}")
    return found


@pytest.mark.clauses("C7", "C12")
@pytest.mark.guards("#49556", "#43226")
def test_local_request_untouched(scenario: ScenarioContext) -> None:
    """A request with no remote prefill completes; the connector reports nothing for it."""
    engine = scenario.engine()
    engine.add_request("local", prompt_len=70, max_tokens=3)
    scenario.run(engine)
    phantom = [f"C7 phantom report: {x}" for x in _reports_naming(engine, "local")]
    scenario.check(engine, ["local"], failed=False, extra=phantom)


@pytest.mark.clauses("C1", "C2", "C8", "C9")
@pytest.mark.guards("#50719", "#35943")
def test_successful_load(scenario: ScenarioContext) -> None:
    """The baseline: an async load completes, P's bytes land in D's blocks, all is freed."""
    scenario.require("remote_prefill", "async_load")
    engine = scenario.engine()
    rid = scenario.rid("ok")
    scenario.add_loading(engine, rid)
    scenario.driver.settle(engine, rid)
    scenario.run(engine)
    extra = []
    if scenario.caps.byte_verification:
        mismatch = scenario.driver.verify_bytes(engine, rid)
        if mismatch:
            extra.append(f"C1 a good load did not deliver P's bytes: {mismatch}")
    scenario.check(engine, [rid], failed=False, extra=extra)


@pytest.mark.clauses("C1", "C2", "C3", "C12")
@pytest.mark.guards("#50719", "#55870", "HF3FS", "LMCache#4600")
def test_failed_load_one_group(scenario: ScenarioContext) -> None:
    """One KV-cache group: a failed async load is reported (on either channel; block-level
    is allowed here), paired with finished_recving no later than that pass, and the policy
    decides the outcome. The toy fails one block (index 1): ``recompute`` keeps block 0."""
    scenario.require("remote_prefill", "async_load")
    # No requirement on a reporting channel: reporting a failed load is a MUST (C1), so a
    # connector without one runs this scenario and fails it, never skips it.
    point = scenario.require_fault(*ACTIVE)
    _load_fails(scenario, point, "bad", provoke=True, block_index=1)


@pytest.mark.clauses("C1", "C2", "C5", "C6")
@pytest.mark.guards("#45474", "#50687", "#53781", "#56855")
def test_failed_load_request_level_two_groups(scenario: ScenarioContext) -> None:
    """Two KV-cache groups (HMA): the failure must go through failed_recving paired with
    finished_recving; a block-level report would raise RuntimeError in the scheduler."""
    # hma is optional (vLLM builds several groups only for a SupportsHMA connector); the
    # request-level channel is not required: with two groups it is a MUST (C5).
    scenario.require("remote_prefill", "async_load", "hma", "two_groups")
    point = scenario.require_fault(*ACTIVE)
    engine = scenario.engine(num_kv_cache_groups=2)
    rid = scenario.rid("bad2")
    blocks = scenario.add_loading(engine, rid, fault=point)
    scenario.driver.provoke(engine, rid, point)
    scenario.run(engine)
    block_level = [
        f"C5: invalid_block_ids {sorted(r.invalid_block_ids)} reported with two groups "
        f"at step {r.step}"
        for r in engine.record.scheduler_reports()
        if r.invalid_block_ids
    ]
    scenario.check(
        engine, [rid], failed=True, extra=[*block_level, *check_not_late(engine, rid, blocks)]
    )


def _load_fails(
    scenario: ScenarioContext,
    point: FaultPoint,
    name: str,
    *,
    provoke: bool = False,
    block_index: int | None = None,
    wrong_bytes: bool = True,
) -> None:
    """One load under ``point`` (with ``provoke``, the driver provokes it, on the block
    at ``block_index`` if given), then :func:`_check_failed`."""
    engine = scenario.engine()
    rid = scenario.rid(name)
    blocks = scenario.add_loading(engine, rid, fault=point)
    if provoke:
        scenario.driver.provoke(engine, rid, point, block_index=block_index)
    _check_failed(scenario, engine, rid, blocks, wrong_bytes=wrong_bytes)


def _check_failed(
    scenario: ScenarioContext,
    engine: Any,
    rid: str,
    blocks: list[int],
    *,
    wrong_bytes: bool = True,
) -> None:
    """Run ``engine`` within the suite's bound and check ``rid`` failed, its failure not
    late (C3) and, with ``wrong_bytes``, not run on as if loaded (C1)."""
    scenario.run(engine)
    _note_detection(scenario, engine, rid)
    extra = _wrong_bytes(scenario, engine, rid) if wrong_bytes else []
    scenario.check(engine, [rid], failed=True, extra=[*extra, *check_not_late(engine, rid, blocks)])


def _wrong_bytes(scenario: ScenarioContext, engine: Any, rid: str) -> list[str]:
    """C1: a failed load must not be run on as if it succeeded (bytes that are not P's)."""
    if not scenario.caps.byte_verification:
        return []
    wrong = scenario.driver.wrong_bytes_finding(engine, rid)
    return [] if wrong is None else [f"C1 wrong bytes reported as success: {wrong}"]


def _note_detection(scenario: ScenarioContext, engine: Any, rid: str) -> float | None:
    """Record how long the connector took to report ``rid`` (report only, never asserted)."""
    seconds = scenario.driver.detection_s(engine, rid)
    if seconds is not None:
        scenario.note("detected_s", seconds)
    return seconds


def _failure_by_deadline(
    scenario: ScenarioContext, point: FaultPoint, *, warm: bool = False, silent: bool = False
) -> None:
    """A fault only the connector's own deadline can end (the scheduler has no timeout).

    D is built with a deadline requested (drivers set the configuration key kvfail's
    connectors read); with ``warm`` it first loads once from the same peer. The deadline
    the suite judges by is the one D's connector *declares* (``kv_load_deadline_s``, see
    :mod:`kvfail.deadline`), never one assumed from its class. The suite waits a bounded
    time: ``--kvfail-silent-wait``, or max(3 x declared deadline + 1 s, 5 s) if that is
    shorter. A load still unreported then is a C10 violation; a report later than the
    declared deadline + a margin is one too. The measured time goes into the report.
    """
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(point)
    engine = scenario.engine(deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    if warm:
        scenario.warm_up(engine)
    rid = scenario.rid(point.value)
    blocks = scenario.add_loading(engine, rid, fault=point)
    scenario.driver.provoke(engine, rid, point)
    budget = scenario.deadline_budget(deadline)
    if silent:  # nothing but the deadline can end it: a wait no connector can save
        scenario.wait_floor(budget if deadline is None else deadline)
    scenario.run(engine, timeout_s=budget)
    extra = check_not_late(engine, rid, blocks)
    seconds = _note_detection(scenario, engine, rid)
    stranded = [rid] if rid in engine.waiting_for_remote() else []
    times = [] if seconds is None else [seconds]
    extra += deadline_findings([rid], stranded, times, deadline, budget)
    scenario.check(engine, [rid], failed=True, extra=[*extra, *_wrong_bytes(scenario, engine, rid)])


@pytest.mark.clauses("C2", "C10", "C11")
@pytest.mark.guards("#35943", "#50754", "LMCache#5047")
def test_silent_peer_caught_by_deadline(scenario: ScenarioContext) -> None:
    """P (or the path to it) never answers: only the connector's own deadline can end the
    load. The first silent fault the driver has (Mooncake: a blackholed bootstrap, so D
    is cold and stuck before any pull)."""
    _failure_by_deadline(scenario, scenario.require_fault(*SILENT), silent=True)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#35943", "#50754")
def test_frozen_peer_caught_by_deadline(scenario: ScenarioContext) -> None:
    """SIGSTOP P after D pulled from it once: P's sockets stay open and accept, nothing
    answers. D cannot tell a frozen P from a slow one; its deadline must end the load."""
    _failure_by_deadline(scenario, FaultPoint.FREEZE_PEER, warm=True, silent=True)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#35943", "#26171")
def test_peer_killed_after_warm_pull(scenario: ScenarioContext) -> None:
    """SIGKILL P after D pulled from it once (D knows P's side channel, so it skips the
    bootstrap): the kernel closes P's sockets, but a reconnecting socket (ZMQ) may never
    notice, so the deadline may be all that ends the load."""
    _failure_by_deadline(scenario, FaultPoint.KILL_BEFORE_PULL, warm=True)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C11")
@pytest.mark.guards("#50719", "#35943")
def test_peer_killed_during_transfer(scenario: ScenarioContext) -> None:
    """SIGKILL P in the middle of writing D's blocks: part of them hold P's bytes, the rest
    do not, and no reply will ever come. D must report the load failed, promptly or by
    its deadline, and never run on the half-written blocks as if they were loaded."""
    _failure_by_deadline(scenario, FaultPoint.KILL_DURING_TRANSFER)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#50719", "#35943")
def test_peer_finishes_without_result(scenario: ScenarioContext) -> None:
    """The real P answers D's pull with FINISH naming no request: nothing will ever come
    for it. A connector must notice (or its deadline must), never strand the request."""
    _failure_by_deadline(scenario, FaultPoint.PEER_FINISH_WITHOUT_RESULT)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50719", "#26171")
def test_peer_killed_before_pull(scenario: ScenarioContext) -> None:
    """SIGKILL P after it prefilled, before a cold D (never talked to P) pulls: D's
    bootstrap query is refused. Reported promptly, paired with finished_recving."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.KILL_BEFORE_PULL)
    # D never pulls (its bootstrap query is refused): there are no bytes to judge.
    _load_fails(scenario, point, "killed", wrong_bytes=False)


@pytest.mark.clauses("C1", "C2", "C3", "C7", "C8")
@pytest.mark.guards("#50719", "#55870")
def test_peer_names_failed_request(scenario: ScenarioContext) -> None:
    """The real P answers D's pull with FINISH and ``err_reqs`` naming the request: the
    failure is reported once, paired with finished_recving, and the policy decides."""
    scenario.require("remote_prefill", "async_load")
    _load_fails(scenario, scenario.require_fault(FaultPoint.PEER_ERR_REQS), "err-reqs")


def _malformed(scenario: ScenarioContext, kind: str) -> None:
    """Add a request whose ``kv_transfer_params`` are P's real ones with one field broken;
    the load must fail and be reported like any other failure: never raised into the
    scheduler (C13), never left waiting (C10). Bounded by the suite's silent wait."""
    scenario.require("remote_prefill", "malformed_params")
    engine = scenario.engine()
    rid = scenario.rid(kind)
    scenario.driver.add_malformed_request(engine, rid, kind)
    scenario.run(engine, timeout_s=scenario.silent_wait_s)
    _note_detection(scenario, engine, rid)
    scenario.check(engine, [rid], failed=True)


@pytest.mark.clauses("C1", "C2", "C10", "C13")
@pytest.mark.guards("#50719", "Mooncake params validation")
def test_params_missing_transfer_id(scenario: ScenarioContext) -> None:
    """``kv_transfer_params`` without ``transfer_id``: D cannot name the transfer to P."""
    _malformed(scenario, "missing_transfer_id")


@pytest.mark.clauses("C1", "C2", "C10", "C13")
@pytest.mark.guards("#50719", "Mooncake params validation")
def test_params_bad_bootstrap_addr(scenario: ScenarioContext) -> None:
    """``remote_bootstrap_addr`` that is not a URL (``127.0.0.1:not-a-port``)."""
    _malformed(scenario, "bad_bootstrap_addr")


@pytest.mark.clauses("C7", "C9", "C10")
@pytest.mark.guards("#32255", "#56089", "#46240", "vllm-ascend#7878")
def test_abort_while_waiting(scenario: ScenarioContext) -> None:
    """Abort a request whose load is in flight, then let the load succeed (and, where the
    driver can, fail): the blocks are held until finished_recving, then all is freed, the
    late signal never names a freed id (watched through the next request D serves), and
    the aborted request produces no tokens."""
    scenario.require("remote_prefill", "async_load")
    scenario.require_fault(FaultPoint.ABORT_WHILE_WAITING)
    late_events: list[FaultPoint | None] = [None]
    active = [p for p in ACTIVE if p in scenario.caps.faults]
    if active:
        late_events.append(active[0])
    found: list[str] = []
    for point in late_events:
        late = "success" if point is None else point.value
        engine = scenario.engine()
        rid = scenario.rid(f"abort-then-{late}")
        scenario.add_loading(engine, rid, fault=point)
        scenario.driver.provoke(engine, rid, FaultPoint.ABORT_WHILE_WAITING)
        engine.run_until_idle(max_steps=3, timeout_s=5.0)
        if point is None:
            scenario.driver.settle(engine, rid)
        else:
            scenario.driver.provoke(engine, rid, point)
        scenario.run(engine)
        scenario.next_traffic(engine)
        found += [
            f"[{late}] {v}" for v in scenario.violations(engine, failed=None, policy_outcome=False)
        ]
        tokens = [t for o in engine.record.outputs_for(rid) for t in o.new_token_ids]
        if tokens:
            found.append(f"[{late}] C9: aborted {rid} generated {len(tokens)} tokens")
    scenario.assert_clean(found)


@pytest.mark.clauses("C7", "C10")
@pytest.mark.guards("#43226", "#57938", "Mooncake no-blocks guard")
def test_notify_only_empty_blocks(scenario: ScenarioContext) -> None:
    """A pull with no local blocks (prompt shorter than a block; a request rejected before
    its first schedule, as abort_immediately does) must not crash, and the connector must
    not report an id the scheduler never gave blocks or already freed."""
    scenario.require("remote_prefill")
    scenario.require_fault(FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS)
    engine = scenario.engine()
    short = scenario.driver.add_remote_request(
        engine, scenario.rid("short"), prompt_len=engine.spec.block_size // 2
    )
    rejected = scenario.driver.add_remote_request(engine, scenario.rid("rejected"))
    engine.abort(rejected)
    scenario.run(engine)
    # A request aborted before its first schedule never waited: any report naming it is a
    # phantom (C7). ``short`` may legitimately load a partial block; check_exactly_once
    # flags a report for it only if it never waited for remote KV.
    extra = [f"C7 phantom report for {rejected}: {x}" for x in _reports_naming(engine, rejected)]
    scenario.check(engine, [short], failed=False, extra=extra)


#: The faults that hit one TP rank alone, preferred order: a cold D's first (P's rank
#: killed before D's first pull), then the same kill once D has loaded from P. Each rank
#: of the TP 2 layouts has its own scenario, so the report names the rank that failed.
ONE_RANK_FAULTS = (FaultPoint.TP_ONE_RANK, FaultPoint.TP_ONE_RANK_WARM)


def _failure_on_one_rank(
    scenario: ScenarioContext, rank: int, *, layouts: tuple[str, ...] = ("tp2", "tp2-g2")
) -> None:
    """TP=2: P's rank ``rank`` fails (a real driver kills it; the toy fails that rank's
    load), the other rank's load succeeds. vLLM's real KVOutputAggregator must still
    deliver the failure once, and no rank may wait forever.

    The fault is the first of :data:`ONE_RANK_FAULTS` the driver can provoke on that rank
    alone, by what it declares: a rank it cannot fault without failing the others (the
    P process that also serves the other ranks' bootstrap) is faulted once D has loaded
    from P (``tp_one_rank_warm``: D asks the bootstrap nothing again), and skipped with
    the driver's reason where it has no such fault. A warm D gets the deadline it asks
    for, bounded as the warm kill of all of P is (``test_peer_killed_after_warm_pull``)."""
    scenario.require("remote_prefill", "async_load", "tp2")
    # A real TP 2 P and D cost a minute or more; the scenario runs in the layouts named
    # (by default the TP 2 ones, where P's rank r serves D's rank r).
    scenario.require_layout(*layouts)
    point = scenario.require_fault_on_rank(rank, *ONE_RANK_FAULTS)
    scenario.note("fault", point.value)
    warm = point is FaultPoint.TP_ONE_RANK_WARM
    engine = scenario.engine(deadline=warm)
    deadline = scenario.declared_deadline_s(engine) if warm else None
    if warm:
        scenario.warm_up(engine)
    rid = scenario.rid(f"tp-rank{rank}")
    # D's ranks that load from a live P rank alone: none where D's ranks each read from
    # every P rank (P's TP larger than D's), so every load is then faulted.
    hetero = scenario.layout.heterogeneous
    others = [] if hetero else [r for r in range(scenario.layout.tp_size) if r != rank]
    blocks = scenario.add_loading(engine, rid, fault=point, ranks=[rank])
    scenario.driver.provoke(engine, rid, point, ranks=[rank], block_index=1)
    scenario.driver.settle(engine, rid, ranks=others)
    budget = scenario.deadline_budget(deadline) if warm else None
    scenario.run(engine, timeout_s=budget)
    extra = check_not_late(engine, rid, blocks)
    if budget is not None:
        seconds = _note_detection(scenario, engine, rid)
        stranded = [rid] if rid in engine.waiting_for_remote() else []
        times = [] if seconds is None else [seconds]
        extra += deadline_findings([rid], stranded, times, deadline, budget)
    scenario.check(engine, [rid], failed=True, extra=[*extra, *_wrong_bytes(scenario, engine, rid)])


@pytest.mark.clauses("C1", "C2", "C6", "C8", "C11")
@pytest.mark.guards("#42422")
def test_tp2_failure_on_one_rank_0(scenario: ScenarioContext) -> None:
    """TP=2, rank 0 fails, rank 1 loads (see :func:`_failure_on_one_rank`)."""
    _failure_on_one_rank(scenario, 0)


@pytest.mark.clauses("C1", "C2", "C6", "C8", "C11")
@pytest.mark.guards("#42422")
def test_tp2_failure_on_one_rank_1(scenario: ScenarioContext) -> None:
    """TP=2, rank 1 fails, rank 0 loads: a connector that reports only what its rank 0
    sees (the rank vLLM's executor answers from) passes rank 0 and fails here."""
    _failure_on_one_rank(scenario, 1)


@pytest.mark.clauses("C1", "C2", "C6", "C8", "C11")
@pytest.mark.guards("#42422")
def test_p_rank_lost_while_d_reads_from_both(scenario: ScenarioContext) -> None:
    """P at TP 2, D at TP 1 (heterogeneous TP): D's one rank reads its KV heads from both
    P ranks, so each load needs both. P's rank 1 fails while rank 0 serves its half: the
    load must be reported failed once, never delivered with half of its heads, and since
    rank 0 may still be writing its half, no block may go back while it can (the
    integrity oracle's watch). Rank 1, because a P whose rank 0 also serves others (the
    bootstrap) cannot lose rank 0 alone for a cold D (see :func:`_failure_on_one_rank`)."""
    _failure_on_one_rank(scenario, 1, layouts=("p2d1", "p2d1-g2"))


def _add_handshake_fault(
    scenario: ScenarioContext, engine: Any, rid: str, point: FaultPoint
) -> list[int]:
    """Like ``scenario.add_loading``, for a fault the peer answers in the handshake: a real
    loopback handshake can fail within the very step that starts the load, so the request
    may end before it is ever seen waiting after a step. It must have entered
    WAITING_FOR_REMOTE_KVS (the engine's record, taken right after ``schedule()``); the
    block ids it held are read while it is still there (none if it failed at once)."""
    scenario.driver.arm(engine, rid, point)
    scenario.driver.add_remote_request(engine, rid)
    blocks: list[int] = []

    def entered(e: Any) -> bool:
        scenario.driver.observe(e)
        if rid in e.waiting_for_remote():
            blocks[:] = [b for g in e.scheduler.kv_cache_manager.get_block_ids(rid) for b in g]
        return any(rid in w for w in e.record.waiting_for_remote)

    result = engine.run_until(entered, max_steps=10, timeout_s=10.0)
    if not result.ok:
        scenario.assert_clean([f"C12 setup: {rid} never entered WAITING_FOR_REMOTE_KVS ({result})"])
    return blocks


def _bad_handshake_metadata(scenario: ScenarioContext, point: FaultPoint) -> None:
    """P answers D's handshake with metadata D cannot use. The load fails at the handshake
    (in a worker thread of D): it must be reported once, paired with finished_recving, and
    the policy decides; never raised into the engine (C13), never left waiting for a READ
    that cannot be posted (C10), and D must not run on KV it never pulled (C1)."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(point)
    engine = scenario.engine()
    rid = scenario.rid(point.value)
    blocks = _add_handshake_fault(scenario, engine, rid, point)
    scenario.driver.provoke(engine, rid, point)
    _check_failed(scenario, engine, rid, blocks)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50765", "#40364", "#41863")
def test_peer_sends_garbled_handshake_metadata(scenario: ScenarioContext) -> None:
    """P's side channel answers with agent metadata the transport cannot load (NIXL:
    ``loadRemoteMD`` rejects the garbled agent bytes, #50765). D fails the load at the
    handshake; before #40364 this killed the engine."""
    _bad_handshake_metadata(scenario, FaultPoint.PEER_BAD_METADATA)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50765", "#40364", "#21577")
def test_peer_sends_mismatched_layout_metadata(scenario: ScenarioContext) -> None:
    """P's side channel answers with well-formed metadata for a KV layout unlike D's (NIXL:
    blocks half D's size, as a P with another head layout sends; its compatibility hash is
    P's real one). D's layout check refuses it (an ``assert`` upstream, #21577), and the
    load fails at the handshake; reading with that layout would land P's bytes at the
    wrong offsets."""
    _bad_handshake_metadata(scenario, FaultPoint.PEER_METADATA_MISMATCH)


@pytest.mark.clauses("C1", "C2", "C7", "C8", "C13")
@pytest.mark.guards("#55854", "#41383", "#43226")
def test_notification_failure_keeps_a_good_load(scenario: ScenarioContext) -> None:
    """D's done-notification to P fails after D pulled P's bytes (and for a request
    aborted before its first schedule, whose pull only notifies). A notification is not a
    load: D's blocks hold P's bytes and nothing can still write into them, so the load is
    reported finished and NOT failed (under ``fail`` it completes; failing it would turn a
    good answer into an error), exactly once; the failed send is never raised into the
    engine (C13) and the aborted id is never reported (C7). P frees its blocks by its send
    lease (NIXL: ``kv_lease_duration``, #41383), which is P's bound, not D's."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.NOTIFY_FAILED)
    engine = scenario.engine()
    rejected = scenario.rid("notify-rejected")
    scenario.driver.arm(engine, rejected, point)
    scenario.driver.add_remote_request(engine, rejected, prompt_len=40)
    engine.abort(rejected)
    rid = scenario.rid("notify-lost")
    scenario.add_loading(engine, rid, fault=point)
    scenario.driver.provoke(engine, rid, point)
    scenario.run(engine)
    _note_detection(scenario, engine, rid)
    extra = [f"C7 phantom report for {rejected}: {x}" for x in _reports_naming(engine, rejected)]
    if scenario.caps.byte_verification:
        mismatch = scenario.driver.verify_bytes(engine, rid)
        if mismatch:
            extra.append(f"C1 a good load went wrong after a failed notification: {mismatch}")
    scenario.check(engine, [rid], failed=False, extra=extra)
