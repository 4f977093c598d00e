"""Checks run after a scenario on a harness :class:`~kvfail.harness.engine.Engine`.

Why separate functions returning lists: a scenario usually breaks several rules at once
(a stall is also a leak), and a test report that names every broken clause is worth more
than the first assertion. Each violation is one string that starts with the clause it
breaks (``docs/contract.md``), e.g. ``"C2/C10 liveness: ..."``. An empty list means the check
passed. The oracles read the real scheduler's state plus the engine's record; they never
change either, so they can run at any point (usually after ``run_until_idle``).

Scheduler attributes read (vLLM 0.32.0; absent ones are skipped so older versions with
``skipped_waiting`` still work): ``requests``, ``waiting``, ``kv_holding_waiting``,
``deferred_waiting``, ``skipped_waiting``, ``running``, ``finished_recving_kv_req_ids``,
``failed_recving_kv_req_ids``, ``deferred_frees``, ``_inflight_prefills``, and the block
pool (``get_num_free_blocks``, ``blocks[*].ref_cnt``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvfail.reporter import FailureReporterMixin

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine
    from kvfail.harness.hooks import RankView
    from kvfail.harness.records import KVReport

__all__ = [
    "check_all",
    "check_exactly_once",
    "check_liveness",
    "check_no_crash",
    "check_no_leaks",
    "check_no_readvertise_after_failure",
    "check_policy_outcome",
    "failed_requests",
]

#: Scheduler collections that must be empty once every request has ended.
_QUEUES: tuple[str, ...] = (
    "requests",
    "waiting",
    "kv_holding_waiting",
    "deferred_waiting",
    "skipped_waiting",
    "running",
    "finished_recving_kv_req_ids",
    "failed_recving_kv_req_ids",
    "deferred_frees",
    "_inflight_prefills",
)


def _ids(collection: object) -> list[str]:
    out: list[str] = []
    for item in list(collection):  # type: ignore[call-overload]
        rid = getattr(item, "request_id", item)
        out.append(rid if isinstance(rid, str) else repr(rid))
    return out


def check_no_crash(engine: Engine) -> list[str]:
    """Nothing raised inside the engine loop (a real EngineCore would have died)."""
    return [
        f"{c.clause} crash: {c.exc_type} in {c.phase} at step {c.step}: {c.message}"
        for c in engine.record.crashes
    ]


def check_liveness(engine: Engine, request_ids: Iterable[str] | None = None) -> list[str]:
    """No request is stuck: none waits for remote KV, none is unfinished, none is held.

    Call after the step budget is spent; the scheduler has no timeout (C10), so a load the
    connector never reports stays in ``WAITING_FOR_REMOTE_KVS`` with its blocks held (C2).
    """
    sched = engine.scheduler
    wanted = None if request_ids is None else set(request_ids)
    steps = engine.record.steps
    out: list[str] = []
    for rid, req in sched.requests.items():
        if wanted is not None and rid not in wanted:
            continue
        held = sum(len(g) for g in sched.kv_cache_manager.get_block_ids(rid))
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            out.append(
                f"C2/C10 liveness: {rid} still in WAITING_FOR_REMOTE_KVS after {steps} steps "
                f"({held} blocks held)"
            )
        elif RequestStatus.is_finished(req.status):
            out.append(
                f"C9 liveness: {rid} finished ({req.status.name}) but still held after "
                f"{steps} steps ({held} blocks): its finished_recving/sending never came"
            )
        else:
            out.append(f"C10 liveness: {rid} unfinished ({req.status.name}) after {steps} steps")
    if wanted is None:
        unfinished = sched.get_num_unfinished_requests()
        if unfinished and not out:
            out.append(f"C10 liveness: {unfinished} unfinished request(s) after {steps} steps")
    return out


def check_no_leaks(engine: Engine) -> list[str]:
    """Every request is gone and every block is back in the pool (C9 when violated).

    Also checks each worker connector that uses :class:`kvfail.FailureReporterMixin`
    tracks no load any more.
    """
    sched = engine.scheduler
    out: list[str] = []
    for name in _QUEUES:
        collection = getattr(sched, name, None)
        if collection is None:
            continue
        if len(collection):
            shown = ", ".join(_ids(collection)[:5])
            out.append(f"C9 leak: scheduler.{name} not empty ({len(collection)}: {shown})")
    pool = sched.kv_cache_manager.block_pool
    expected = engine.spec.num_blocks - 1  # the null block is never free
    free = pool.get_num_free_blocks()
    if free != expected:
        out.append(f"C9 leak: {free} free blocks, expected {expected}")
    referenced = [b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt != 0]
    if referenced:
        out.append(f"C9 leak: blocks with ref_cnt != 0: {referenced[:10]}")
    for worker in engine.workers:
        left = worker.call(tracked_loads, world_size=len(engine.workers))
        if left:
            out.append(f"C9 leak: worker[{worker.rank}] still tracks {left} load(s)")
    return out


def tracked_loads(view: RankView) -> int:
    """On a rank: loads a kvfail connector still tracks (0 for any other connector)."""
    connector = view.connector
    if isinstance(connector, FailureReporterMixin) and connector._kvfail_tracker:
        return len(connector.failure_reporter)
    return 0


def failed_requests(engine: Engine) -> dict[str, list[int]]:
    """Request id -> steps in which the scheduler received a failure for it."""
    steps: dict[str, list[int]] = {}
    for report in engine.record.scheduler_reports():
        for rid in report.failed_requests:
            steps.setdefault(rid, []).append(report.step)
    return steps


def check_policy_outcome(
    engine: Engine, request_id: str, *, failed: bool | None = None
) -> list[str]:
    """The request ended as its policy says, with exactly one finishing output.

    ``failed``: whether the scenario made this request's load fail; None infers it from
    the record (a failure report reached the scheduler). ``fail`` policy with a failure:
    ``FinishReason.ERROR`` once (``FINISHED_ERROR``). ``recompute``, or no failure: the
    request completes normally (stop or length), never with an error.
    """
    observed = request_id in failed_requests(engine)
    out: list[str] = []
    if failed is None:
        failed = observed
    elif failed and not observed:
        out.append(
            f"C1 unreported: {request_id}'s load failed but no failure reached the scheduler"
        )
    finishes = [o for o in engine.record.outputs_for(request_id) if o.finish_reason is not None]
    reasons = [o.finish_reason for o in finishes]
    request = engine.requests.get(request_id)
    status = None if request is None else request.status
    policy = engine.spec.policy
    if len(finishes) != 1:
        out.append(
            f"C1 policy/{policy}: {request_id} has {len(finishes)} finishing outputs "
            f"({[str(r) for r in reasons]}), expected exactly 1"
        )
    if failed and policy == "fail":
        if reasons != [FinishReason.ERROR] or status != RequestStatus.FINISHED_ERROR:
            out.append(
                f"C1 policy/fail: {request_id} should end FINISHED_ERROR with one error "
                f"output; status={status}, reasons={[str(r) for r in reasons]}"
            )
    else:
        ok = {FinishReason.STOP, FinishReason.LENGTH}
        if not reasons or any(r not in ok for r in reasons):
            out.append(
                f"C1 policy/{policy}: {request_id} should complete normally; "
                f"status={status}, reasons={[str(r) for r in reasons]}"
            )
    return out


def _per_id(reports: Iterable[KVReport], attr: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for report in reports:
        counts.update(getattr(report, attr))
    return counts


def check_exactly_once(engine: Engine) -> list[str]:
    """Each load is reported finished once per worker, and each failure once per rank (C8).

    A "load" is one entry into ``WAITING_FOR_REMOTE_KVS``; a request re-loaded after a
    ``recompute`` rewind may legitimately be reported once per load.
    """
    record = engine.record
    out: list[str] = []
    views: list[tuple[str, list[KVReport]]] = [
        (f"worker[{w.rank}]", record.rank_reports(w.rank)) for w in engine.workers
    ]
    views.append(("scheduler", record.scheduler_reports()))
    for who, reports in views:
        for attr in ("finished_recving", "failed_recving"):
            for rid, n in _per_id(reports, attr).items():
                loads = record.load_episodes(rid)
                if loads == 0:
                    out.append(
                        f"C7: {who} reported {rid} in {attr} but it never waited for remote KV"
                    )
                elif n > loads:
                    out.append(f"C8: {who} reported {rid} in {attr} {n} times over {loads} load(s)")
    # At TP > 1 each rank reports its own failure when it happens, and vLLM's
    # KVOutputAggregator forwards block-level failures in the step they arrive (only
    # finished_recving waits for every rank). Two ranks failing in different steps are
    # therefore two scheduler reports; the scheduler only tightens the valid prefix on
    # the second. So the bound is once per rank per load.
    ranks = len(engine.workers)
    for rid, steps in failed_requests(engine).items():
        loads = record.load_episodes(rid)
        if len(steps) > max(loads, 1) * ranks:
            per = "" if ranks == 1 else f" x {ranks} ranks"
            out.append(
                f"C8: failure of {rid} reached the scheduler in {len(steps)} steps "
                f"({steps}) over {loads} load(s){per}"
            )
    return out


def check_no_readvertise_after_failure(engine: Engine) -> list[str]:
    """After a failed load, the connector's next lookup must miss (C12, vLLM #55297).

    Violated when a request re-enters ``WAITING_FOR_REMOTE_KVS`` after the step in which
    its failure reached the scheduler: the load-fail-reload loop.
    """
    out: list[str] = []
    for rid, steps in failed_requests(engine).items():
        first = min(steps)
        again = [s for s in engine.record.load_start_steps(rid) if s > first]
        if again:
            out.append(
                f"C12 (#55297): {rid} re-entered WAITING_FOR_REMOTE_KVS at step "
                f"{again[0]} after its load failed at step {first} "
                f"({len(again)} reload(s))"
            )
    return out


def check_all(
    engine: Engine, request_ids: Iterable[str] | None = None, *, failed: bool | None = None
) -> list[str]:
    """Every oracle; policy outcome for ``request_ids`` (default: every request added)."""
    ids = list(engine.requests) if request_ids is None else list(request_ids)
    out = check_no_crash(engine)
    out += check_liveness(engine)
    out += check_no_leaks(engine)
    out += check_exactly_once(engine)
    out += check_no_readvertise_after_failure(engine)
    for rid in ids:
        out += check_policy_outcome(engine, rid, failed=failed)
    return out
