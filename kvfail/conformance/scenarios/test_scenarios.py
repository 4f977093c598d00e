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

from kvfail.conformance.suite import check_not_late, deadline_findings
from kvfail.faults.points import FaultPoint

# The clauses each scenario cites (@pytest.mark.clauses) are defined in docs/contract.md.
pytestmark = pytest.mark.vllm

#: Faults a connector notices promptly, preferred order (the toy can only do the first).
ACTIVE = (
    FaultPoint.PEER_ERROR_RESPONSE,
    FaultPoint.KILL_DURING_TRANSFER,
    FaultPoint.NET_RESET,
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
def test_local_request_untouched(kvfail: Any) -> None:
    """A request with no remote prefill completes; the connector reports nothing for it."""
    engine = kvfail.engine()
    engine.add_request("local", prompt_len=70, max_tokens=3)
    kvfail.run(engine)
    phantom = [f"C7 phantom report: {x}" for x in _reports_naming(engine, "local")]
    kvfail.check(engine, ["local"], failed=False, extra=phantom)


@pytest.mark.clauses("C1", "C2", "C8", "C9")
@pytest.mark.guards("#50719", "#35943")
def test_successful_load(kvfail: Any) -> None:
    """The baseline: an async load completes, P's bytes land in D's blocks, all is freed."""
    kvfail.require("remote_prefill", "async_load")
    engine = kvfail.engine()
    rid = kvfail.rid("ok")
    kvfail.add_loading(engine, rid)
    kvfail.driver.settle(engine, rid)
    kvfail.run(engine)
    extra = []
    if kvfail.caps.byte_verification:
        mismatch = kvfail.driver.verify_bytes(engine, rid)
        if mismatch:
            extra.append(f"C1 a good load did not deliver P's bytes: {mismatch}")
    kvfail.check(engine, [rid], failed=False, extra=extra)


@pytest.mark.clauses("C1", "C2", "C3", "C12")
@pytest.mark.guards("#50719", "#55870", "HF3FS", "LMCache#4600")
def test_failed_load_one_group(kvfail: Any) -> None:
    """One KV-cache group: a failed async load is reported (on either channel; block-level
    is allowed here), paired with finished_recving no later than that pass, and the policy
    decides the outcome. The toy fails one block (index 1): ``recompute`` keeps block 0."""
    kvfail.require("remote_prefill", "async_load")
    # No requirement on a reporting channel: reporting a failed load is a MUST (C1), so a
    # connector without one runs this scenario and fails it, never skips it.
    point = kvfail.require_fault(*ACTIVE)
    engine = kvfail.engine()
    rid = kvfail.rid("bad")
    blocks = kvfail.add_loading(engine, rid, fault=point)
    kvfail.driver.provoke(engine, rid, point, block_index=1)
    kvfail.run(engine)
    _note_detection(kvfail, engine, rid)
    kvfail.check(
        engine,
        [rid],
        failed=True,
        extra=[*_wrong_bytes(kvfail, engine, rid), *check_not_late(engine, rid, blocks)],
    )


@pytest.mark.clauses("C1", "C2", "C5", "C6")
@pytest.mark.guards("#45474", "#50687", "#53781", "#56855")
def test_failed_load_request_level_two_groups(kvfail: Any) -> None:
    """Two KV-cache groups (HMA): the failure must go through failed_recving paired with
    finished_recving; a block-level report would raise RuntimeError in the scheduler."""
    # hma is optional (vLLM builds several groups only for a SupportsHMA connector); the
    # request-level channel is not required: with two groups it is a MUST (C5).
    kvfail.require("remote_prefill", "async_load", "hma", "two_groups")
    point = kvfail.require_fault(*ACTIVE)
    engine = kvfail.engine(num_kv_cache_groups=2)
    rid = kvfail.rid("bad2")
    blocks = kvfail.add_loading(engine, rid, fault=point)
    kvfail.driver.provoke(engine, rid, point)
    kvfail.run(engine)
    block_level = [
        f"C5: invalid_block_ids {sorted(r.invalid_block_ids)} reported with two groups "
        f"at step {r.step}"
        for r in engine.record.scheduler_reports()
        if r.invalid_block_ids
    ]
    kvfail.check(
        engine, [rid], failed=True, extra=[*block_level, *check_not_late(engine, rid, blocks)]
    )


def _wrong_bytes(kvfail: Any, engine: Any, rid: str) -> list[str]:
    """C1: a failed load must not be run on as if it succeeded (bytes that are not P's)."""
    if not kvfail.caps.byte_verification:
        return []
    wrong = kvfail.driver.used_wrong_bytes(engine, rid)
    return [] if wrong is None else [f"C1 wrong bytes reported as success: {wrong}"]


def _note_detection(kvfail: Any, engine: Any, rid: str) -> float | None:
    """Record how long the connector took to report ``rid`` (report only, never asserted)."""
    seconds = kvfail.driver.detection_s(engine, rid)
    if seconds is not None:
        kvfail.note("detected_s", seconds)
    return seconds


def _failure_by_deadline(
    kvfail: Any, point: FaultPoint, *, warm: bool = False, silent: bool = False
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
    kvfail.require("remote_prefill", "async_load")
    point = kvfail.require_fault(point)
    engine = kvfail.engine(deadline=True)
    deadline = kvfail.declared_deadline_s(engine)
    if warm:
        kvfail.warm_up(engine)
    rid = kvfail.rid(point.value)
    blocks = kvfail.add_loading(engine, rid, fault=point)
    kvfail.driver.provoke(engine, rid, point)
    budget = kvfail.deadline_budget(deadline)
    if silent:  # nothing but the deadline can end it: a wait no connector can save
        kvfail.wait_floor(budget if deadline is None else deadline)
    kvfail.run(engine, timeout_s=budget)
    extra = check_not_late(engine, rid, blocks)
    seconds = _note_detection(kvfail, engine, rid)
    stranded = [rid] if rid in engine.waiting_for_remote() else []
    times = [] if seconds is None else [seconds]
    extra += deadline_findings([rid], stranded, times, deadline, budget)
    kvfail.check(engine, [rid], failed=True, extra=[*extra, *_wrong_bytes(kvfail, engine, rid)])


@pytest.mark.clauses("C2", "C10", "C11")
@pytest.mark.guards("#35943", "#50754", "LMCache#5047")
def test_silent_peer_caught_by_deadline(kvfail: Any) -> None:
    """P (or the path to it) never answers: only the connector's own deadline can end the
    load. The first silent fault the driver has (Mooncake: a blackholed bootstrap, so D
    is cold and stuck before any pull)."""
    _failure_by_deadline(kvfail, kvfail.require_fault(*SILENT), silent=True)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#35943", "#50754")
def test_frozen_peer_caught_by_deadline(kvfail: Any) -> None:
    """SIGSTOP P after D pulled from it once: P's sockets stay open and accept, nothing
    answers. D cannot tell a frozen P from a slow one; its deadline must end the load."""
    _failure_by_deadline(kvfail, FaultPoint.FREEZE_PEER, warm=True, silent=True)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#35943", "#26171")
def test_peer_killed_after_warm_pull(kvfail: Any) -> None:
    """SIGKILL P after D pulled from it once (D knows P's side channel, so it skips the
    bootstrap): the kernel closes P's sockets, but a reconnecting socket (ZMQ) may never
    notice, so the deadline may be all that ends the load."""
    _failure_by_deadline(kvfail, FaultPoint.KILL_BEFORE_PULL, warm=True)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C11")
@pytest.mark.guards("#50719", "#35943")
def test_peer_killed_during_transfer(kvfail: Any) -> None:
    """SIGKILL P in the middle of writing D's blocks: part of them hold P's bytes, the rest
    do not, and no reply will ever come. D must report the load failed, promptly or by
    its deadline, and never run on the half-written blocks as if they were loaded."""
    _failure_by_deadline(kvfail, FaultPoint.KILL_DURING_TRANSFER)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#50719", "#35943")
def test_peer_finishes_without_result(kvfail: Any) -> None:
    """The real P answers D's pull with FINISH naming no request: nothing will ever come
    for it. A connector must notice (or its deadline must), never strand the request."""
    _failure_by_deadline(kvfail, FaultPoint.PEER_FINISH_WITHOUT_RESULT)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50719", "#26171")
def test_peer_killed_before_pull(kvfail: Any) -> None:
    """SIGKILL P after it prefilled, before a cold D (never talked to P) pulls: D's
    bootstrap query is refused. Reported promptly, paired with finished_recving."""
    kvfail.require("remote_prefill", "async_load")
    point = kvfail.require_fault(FaultPoint.KILL_BEFORE_PULL)
    engine = kvfail.engine()
    rid = kvfail.rid("killed")
    blocks = kvfail.add_loading(engine, rid, fault=point)
    kvfail.run(engine)
    _note_detection(kvfail, engine, rid)
    kvfail.check(engine, [rid], failed=True, extra=check_not_late(engine, rid, blocks))


@pytest.mark.clauses("C1", "C2", "C3", "C7", "C8")
@pytest.mark.guards("#50719", "#55870")
def test_peer_names_failed_request(kvfail: Any) -> None:
    """The real P answers D's pull with FINISH and ``err_reqs`` naming the request: the
    failure is reported once, paired with finished_recving, and the policy decides."""
    kvfail.require("remote_prefill", "async_load")
    point = kvfail.require_fault(FaultPoint.PEER_ERR_REQS)
    engine = kvfail.engine()
    rid = kvfail.rid("err-reqs")
    blocks = kvfail.add_loading(engine, rid, fault=point)
    kvfail.run(engine)
    _note_detection(kvfail, engine, rid)
    extra = [*_wrong_bytes(kvfail, engine, rid), *check_not_late(engine, rid, blocks)]
    kvfail.check(engine, [rid], failed=True, extra=extra)


def _malformed(kvfail: Any, kind: str) -> None:
    """Add a request whose ``kv_transfer_params`` are P's real ones with one field broken;
    the load must fail and be reported like any other failure: never raised into the
    scheduler (C13), never left waiting (C10). Bounded by the suite's silent wait."""
    kvfail.require("remote_prefill", "malformed_params")
    engine = kvfail.engine()
    rid = kvfail.rid(kind)
    kvfail.driver.add_malformed_request(engine, rid, kind)
    kvfail.run(engine, timeout_s=kvfail.silent_wait_s)
    _note_detection(kvfail, engine, rid)
    kvfail.check(engine, [rid], failed=True)


@pytest.mark.clauses("C1", "C2", "C10", "C13")
@pytest.mark.guards("#50719", "Mooncake params validation")
def test_params_missing_transfer_id(kvfail: Any) -> None:
    """``kv_transfer_params`` without ``transfer_id``: D cannot name the transfer to P."""
    _malformed(kvfail, "missing_transfer_id")


@pytest.mark.clauses("C1", "C2", "C10", "C13")
@pytest.mark.guards("#50719", "Mooncake params validation")
def test_params_bad_bootstrap_addr(kvfail: Any) -> None:
    """``remote_bootstrap_addr`` that is not a URL (``127.0.0.1:not-a-port``)."""
    _malformed(kvfail, "bad_bootstrap_addr")


@pytest.mark.clauses("C7", "C9", "C10")
@pytest.mark.guards("#32255", "#56089", "#46240", "vllm-ascend#7878")
def test_abort_while_waiting(kvfail: Any) -> None:
    """Abort a request whose load is in flight, then let the load succeed (and, where the
    driver can, fail): the blocks are held until finished_recving, then all is freed, the
    late signal never names a freed id, and the aborted request produces no tokens."""
    kvfail.require("remote_prefill", "async_load")
    kvfail.require_fault(FaultPoint.ABORT_WHILE_WAITING)
    late_events: list[FaultPoint | None] = [None]
    active = [p for p in ACTIVE if p in kvfail.caps.faults]
    if active:
        late_events.append(active[0])
    found: list[str] = []
    for point in late_events:
        late = "success" if point is None else point.value
        engine = kvfail.engine()
        rid = kvfail.rid(f"abort-then-{late}")
        kvfail.add_loading(engine, rid, fault=point)
        kvfail.driver.provoke(engine, rid, FaultPoint.ABORT_WHILE_WAITING)
        engine.run_until_idle(max_steps=3, timeout_s=5.0)
        if point is None:
            kvfail.driver.settle(engine, rid)
        else:
            kvfail.driver.provoke(engine, rid, point)
        kvfail.run(engine)
        found += [
            f"[{late}] {v}" for v in kvfail.violations(engine, failed=None, policy_outcome=False)
        ]
        tokens = [t for o in engine.record.outputs_for(rid) for t in o.new_token_ids]
        if tokens:
            found.append(f"[{late}] C9: aborted {rid} generated {len(tokens)} tokens")
    kvfail.assert_clean(found)


@pytest.mark.clauses("C7", "C10")
@pytest.mark.guards("#43226", "#57938", "Mooncake no-blocks guard")
def test_notify_only_empty_blocks(kvfail: Any) -> None:
    """A pull with no local blocks (prompt shorter than a block; a request rejected before
    its first schedule, as abort_immediately does) must not crash, and the connector must
    not report an id the scheduler never gave blocks or already freed."""
    kvfail.require("remote_prefill")
    kvfail.require_fault(FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS)
    engine = kvfail.engine()
    short = kvfail.driver.add_remote_request(
        engine, kvfail.rid("short"), prompt_len=engine.spec.block_size // 2
    )
    rejected = kvfail.driver.add_remote_request(engine, kvfail.rid("rejected"))
    engine.abort(rejected)
    kvfail.run(engine)
    # A request aborted before its first schedule never waited: any report naming it is a
    # phantom (C7). ``short`` may legitimately load a partial block; check_exactly_once
    # flags a report for it only if it never waited for remote KV.
    extra = [f"C7 phantom report for {rejected}: {x}" for x in _reports_naming(engine, rejected)]
    kvfail.check(engine, [short], failed=False, extra=extra)


@pytest.mark.clauses("C1", "C2", "C6", "C8", "C11")
@pytest.mark.guards("#42422")
def test_tp2_failure_on_one_rank(kvfail: Any) -> None:
    """TP=2: rank 0's load fails, rank 1's succeeds. vLLM's real KVOutputAggregator must
    still deliver the failure once, and no rank may wait forever."""
    kvfail.require("remote_prefill", "async_load", "tp2")
    kvfail.require_fault(FaultPoint.TP_ONE_RANK)
    if kvfail.layout.tp_size < 2:
        # A real TP 2 P and D cost a minute or more; the scenario runs in the TP 2 layouts.
        kvfail.require_layout("tp2", "tp2-g2")
    engine = kvfail.engine()
    rid = kvfail.rid("tp")
    blocks = kvfail.add_loading(engine, rid, fault=FaultPoint.TP_ONE_RANK)
    kvfail.driver.provoke(engine, rid, FaultPoint.TP_ONE_RANK, ranks=[0], block_index=1)
    kvfail.driver.settle(engine, rid, ranks=[1])
    kvfail.run(engine)
    kvfail.check(engine, [rid], failed=True, extra=check_not_late(engine, rid, blocks))


def _add_handshake_fault(kvfail: Any, engine: Any, rid: str, point: FaultPoint) -> list[int]:
    """Like ``kvfail.add_loading``, for a fault the peer answers in the handshake: a real
    loopback handshake can fail within the very step that starts the load, so the request
    may end before it is ever seen waiting after a step. It must have entered
    WAITING_FOR_REMOTE_KVS (the engine's record, taken right after ``schedule()``); the
    block ids it held are read while it is still there (none if it failed at once)."""
    kvfail.driver.arm(engine, rid, point)
    kvfail.driver.add_remote_request(engine, rid)
    blocks: list[int] = []

    def entered(e: Any) -> bool:
        kvfail.driver.observe(e)
        if rid in e.waiting_for_remote():
            blocks[:] = [b for g in e.scheduler.kv_cache_manager.get_block_ids(rid) for b in g]
        return any(rid in w for w in e.record.waiting_for_remote)

    result = engine.run_until(entered, max_steps=10, timeout_s=10.0)
    if not result.ok:
        kvfail.assert_clean([f"C12 setup: {rid} never entered WAITING_FOR_REMOTE_KVS ({result})"])
    return blocks


def _bad_handshake_metadata(kvfail: Any, point: FaultPoint) -> None:
    """P answers D's handshake with metadata D cannot use. The load fails at the handshake
    (in a worker thread of D): it must be reported once, paired with finished_recving, and
    the policy decides; never raised into the engine (C13), never left waiting for a READ
    that cannot be posted (C10), and D must not run on KV it never pulled (C1)."""
    kvfail.require("remote_prefill", "async_load")
    point = kvfail.require_fault(point)
    engine = kvfail.engine()
    rid = kvfail.rid(point.value)
    blocks = _add_handshake_fault(kvfail, engine, rid, point)
    kvfail.driver.provoke(engine, rid, point)
    kvfail.run(engine)
    _note_detection(kvfail, engine, rid)
    extra = [*_wrong_bytes(kvfail, engine, rid), *check_not_late(engine, rid, blocks)]
    kvfail.check(engine, [rid], failed=True, extra=extra)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50765", "#40364", "#41863")
def test_peer_sends_garbled_handshake_metadata(kvfail: Any) -> None:
    """P's side channel answers with agent metadata the transport cannot load (NIXL:
    ``loadRemoteMD`` rejects the garbled agent bytes, #50765). D fails the load at the
    handshake; before #40364 this killed the engine."""
    _bad_handshake_metadata(kvfail, FaultPoint.PEER_BAD_METADATA)


@pytest.mark.clauses("C1", "C2", "C3", "C10", "C13")
@pytest.mark.guards("#50765", "#40364", "#21577")
def test_peer_sends_mismatched_layout_metadata(kvfail: Any) -> None:
    """P's side channel answers with well-formed metadata for a KV layout unlike D's (NIXL:
    blocks half D's size, as a P with another head layout sends; its compatibility hash is
    P's real one). D's layout check refuses it (an ``assert`` upstream, #21577), and the
    load fails at the handshake; reading with that layout would land P's bytes at the
    wrong offsets."""
    _bad_handshake_metadata(kvfail, FaultPoint.PEER_METADATA_MISMATCH)


@pytest.mark.clauses("C1", "C2", "C7", "C8", "C13")
@pytest.mark.guards("#55854", "#41383", "#43226")
def test_notification_failure_keeps_a_good_load(kvfail: Any) -> None:
    """D's done-notification to P fails after D pulled P's bytes (and for a request
    aborted before its first schedule, whose pull only notifies). A notification is not a
    load: D's blocks hold P's bytes and nothing can still write into them, so the load is
    reported finished and NOT failed (under ``fail`` it completes; failing it would turn a
    good answer into an error), exactly once; the failed send is never raised into the
    engine (C13) and the aborted id is never reported (C7). P frees its blocks by its send
    lease (NIXL: ``kv_lease_duration``, #41383), which is P's bound, not D's."""
    kvfail.require("remote_prefill", "async_load")
    point = kvfail.require_fault(FaultPoint.NOTIFY_FAILED)
    engine = kvfail.engine()
    rejected = kvfail.rid("notify-rejected")
    kvfail.driver.arm(engine, rejected, point)
    kvfail.driver.add_remote_request(engine, rejected, prompt_len=40)
    engine.abort(rejected)
    rid = kvfail.rid("notify-lost")
    kvfail.add_loading(engine, rid, fault=point)
    kvfail.driver.provoke(engine, rid, point)
    kvfail.run(engine)
    _note_detection(kvfail, engine, rid)
    extra = [f"C7 phantom report for {rejected}: {x}" for x in _reports_naming(engine, rejected)]
    if kvfail.caps.byte_verification:
        mismatch = kvfail.driver.verify_bytes(engine, rid)
        if mismatch:
            extra.append(f"C1 a good load went wrong after a failed notification: {mismatch}")
    kvfail.check(engine, [rid], failed=False, extra=extra)
