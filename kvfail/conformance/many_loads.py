"""Building blocks of the scenarios that put many loads in flight through one D at once
(the concurrency scenarios and the soak): start a batch, and judge it.

Why a module of its own, outside the ``test_*`` scenario modules: the soak starts and
judges its batches as the concurrency scenarios do, and a scenario module imported by
another would have its scenarios collected twice. Nothing here imports vLLM; the
scenarios do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvfail.conformance.report_timing import check_not_late
from kvfail.conformance.suite import ScenarioContext

if TYPE_CHECKING:
    from kvfail.faults.points import FaultPoint

__all__ = [
    "PROMPT_LEN",
    "add_by_fault",
    "failed_at",
    "not_late",
    "note_failure_steps",
    "reports_after_free",
    "start_loads",
    "wrong_bytes",
]

#: Prompt of each request: one block to load (block size 32). Small, because D's and P's
#: 63 usable blocks must hold a whole batch of requests in two KV-cache groups, and P keeps
#: a failed pull's blocks until its abort timeout, across scenarios.
PROMPT_LEN = 40


def add_by_fault(
    scenario: ScenarioContext,
    engine: Any,
    faults: Mapping[str, FaultPoint | None],
    *,
    prompt_len: int = PROMPT_LEN,
) -> None:
    """Add every request of ``faults`` (request id -> the fault armed for it; None: none)
    before D steps, one ``add_remote_requests`` call per fault, each group in the order
    given.

    Why grouped: a driver over a real P has P prefill one call's requests in one command,
    where a call per request costs a round trip each. Each fault is still armed per
    request, so only faults that fail their own request belong here; a fault on P's
    whole process would happen once per group instead of once per request."""
    groups: dict[FaultPoint | None, list[str]] = {}
    for rid, point in faults.items():
        groups.setdefault(point, []).append(rid)
    for point, rids in groups.items():
        scenario.driver.add_remote_requests(engine, rids, fault=point, prompt_len=prompt_len)


def start_loads(scenario: ScenarioContext, engine: Any, rids: list[str]) -> dict[str, list[int]]:
    """Step until every request in ``rids`` has entered WAITING_FOR_REMOTE_KVS (the
    engine's record: over a real transport a load may end within the step that starts
    it). Returns the block ids each held while it waited, read while it still did (none
    if it ended at once), for :func:`check_not_late`."""
    blocks: dict[str, list[int]] = {rid: [] for rid in rids}

    def entered(e: Any) -> bool:
        scenario.driver.observe(e)
        waiting = e.waiting_for_remote()
        for rid in rids:
            if rid in waiting and not blocks[rid]:
                groups = e.scheduler.kv_cache_manager.get_block_ids(rid)
                blocks[rid] = [b for g in groups for b in g]
        seen = set().union(*e.record.waiting_for_remote)
        return all(rid in seen for rid in rids)

    result = engine.run_until(entered, max_steps=10, timeout_s=10.0)
    seen = set().union(*engine.record.waiting_for_remote)
    missing = [rid for rid in rids if rid not in seen]
    # Only a load that never started is a setup failure: an engine that crashed once they
    # all had (a failure reported on a channel the layout forbids, C5) is the oracles' to
    # judge, under its own clause.
    if missing:
        scenario.assert_clean(
            [f"C12 setup: {missing} never entered WAITING_FOR_REMOTE_KVS ({result})"]
        )
    return blocks


def not_late(engine: Any, blocks: dict[str, list[int]]) -> list[str]:
    """C3 for every load of a batch, on the blocks :func:`start_loads` read."""
    return [v for rid, ids in blocks.items() for v in check_not_late(engine, rid, ids)]


def wrong_bytes(scenario: ScenarioContext, engine: Any, rids: list[str]) -> list[str]:
    """C1: no failed load may be run on as if it succeeded (bytes that are not P's)."""
    if not scenario.caps.byte_verification:
        return []
    found = (scenario.driver.wrong_bytes_finding(engine, rid) for rid in rids)
    return [f"C1 wrong bytes reported as success: {w}" for w in found if w is not None]


def failed_at(engine: Any, rids: list[str]) -> dict[str, list[int]]:
    """Request id -> steps in which a failure for it reached the scheduler."""
    wanted = set(rids)
    steps: dict[str, list[int]] = {}
    for report in engine.record.scheduler_reports():
        for rid in report.failed_requests & wanted:
            steps.setdefault(rid, []).append(report.step)
    return steps


def note_failure_steps(scenario: ScenarioContext, engine: Any, rids: list[str]) -> None:
    """Record in how many distinct steps the failures reached the scheduler (report only)."""
    steps = {s for found in failed_at(engine, rids).values() for s in found}
    scenario.note("failure_steps", len(steps))


def reports_after_free(engine: Any, rid: str) -> list[str]:
    """C7: reports naming ``rid`` after the step whose finished_recving let the scheduler
    free it (an aborted request is freed then)."""
    finished = [r.step for r in engine.record.scheduler_reports() if rid in r.finished_recving]
    if not finished:
        return []
    freed = min(finished)
    out = []
    for r in engine.record.kv_reports:
        if r.step <= freed:
            continue
        for attr in ("finished_recving", "failed_recving"):
            if rid in getattr(r, attr):
                who = "scheduler" if r.rank is None else f"worker[{r.rank}]"
                out.append(
                    f"C7 freed id: {who} reported {rid} in {attr} at step {r.step}, after "
                    f"the scheduler freed it at step {freed}"
                )
    return out
