"""The soak: many batches of loads through one long-lived D, each request with a fault
drawn from a seeded plan.

Why: a bug that one load never shows (a slot, a counter or a block that leaks per
failure, one failure lost per batch) adds up over ``SOAK_BATCHES`` batches of mixed
outcomes: successes, per-request failures and aborts, summed over every request by the
same oracles as the concurrency scenarios (``test_concurrency.py``). The plan, the
request ids and so the prompts derive from ``--kvfail-seed`` alone, so a failing soak
replays from the seed it prints. Named to sort right after ``test_concurrency.py``, which
held it once, so pytest still runs it at the same place in the suite.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.many_loads import (
    add_by_fault,
    failed_at,
    not_late,
    reports_after_free,
    start_loads,
    wrong_bytes,
)
from kvfail.conformance.suite import DEFAULT_SEED, ScenarioContext
from kvfail.faults.points import FaultPoint
from kvfail.harness import oracles

pytestmark = pytest.mark.vllm

#: The soak: batches of loads through one D, each request with a fault drawn from a
#: seeded plan. A batch's requests (2 blocks each per KV-cache group) fit D's 63 usable
#: blocks with two groups.
SOAK_SEED = DEFAULT_SEED
SOAK_BATCHES = 15
SOAK_BATCH = 14
#: Faults that fail only their own request (never P, never another request of the same
#: pull), for the soak. An error reply answers a whole pull where pulls are batched, so it
#: is used only where neither of the others is advertised (the toy's is per request).
SOAK_FAILS = (FaultPoint.PEER_ERR_REQS, FaultPoint.UNKNOWN_ENGINE)
SOAK_FAILS_FALLBACK = FaultPoint.PEER_ERROR_RESPONSE
#: Plan weights: a plain success, a failure (one of the soak's failing faults), an abort.
SOAK_WEIGHTS = {"success": 5, "fail": 3, "abort": 2}


def soak_plan(
    scenario: ScenarioContext, rng: random.Random, batches: int
) -> list[FaultPoint | None]:
    """``batches`` x ``SOAK_BATCH`` faults drawn with ``SOAK_WEIGHTS`` over what the driver
    advertises (None: a plain success). Only faults that fail their own request: none
    kills or freezes the P every request shares, none fails a whole pull next to good
    requests. The plan is drawn whole (at least ``SOAK_BATCHES`` batches) and then cut,
    so a shorter soak (``--kvfail-soak-batches``) runs the first batches of the same plan."""
    n = max(batches, SOAK_BATCHES) * SOAK_BATCH
    faults = scenario.caps.faults
    fails = [p for p in SOAK_FAILS if p in faults]
    if not fails and SOAK_FAILS_FALLBACK in faults:
        fails = [SOAK_FAILS_FALLBACK]
    kinds = [k for k in SOAK_WEIGHTS if k == "success" or (k == "fail" and fails)]
    if FaultPoint.ABORT_WHILE_WAITING in faults:
        kinds.append("abort")
    weights = [SOAK_WEIGHTS[k] for k in kinds]
    plan: list[FaultPoint | None] = []
    for kind in rng.choices(kinds, weights=weights, k=n):
        if kind == "fail":
            plan.append(rng.choice(fails))
        else:
            plan.append(FaultPoint.ABORT_WHILE_WAITING if kind == "abort" else None)
    return plan[: batches * SOAK_BATCH]


def _rss_kib() -> int | None:
    """This process's resident set (D's scheduler and, at TP 1, its worker), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@pytest.mark.clauses("C1", "C2", "C3", "C7", "C8", "C9", "C10", "C11")
@pytest.mark.guards("#50719", "#55870", "#32255")
def test_soak_random_faults(scenario: ScenarioContext) -> None:
    """``SOAK_BATCHES`` (``--kvfail-soak-batches``) x ``SOAK_BATCH`` loads from one P through ONE
    long-lived D, each with a fault drawn from a seeded plan (``--kvfail-seed``, default
    ``SOAK_SEED``; noted with the counts) over the driver's per-request faults: a plain success,
    a failure of that request only, or an abort while it waits. Bugs that one load never shows
    (a slot, a counter or a block that leaks per failure, one failure lost per batch) add up
    here. Summed over every request: all resolved, nothing leaked, each reported exactly once,
    never late, each ends as its plan says (successes on P's bytes), and the KV-integrity oracle
    holds. A batch that does not drain ends the soak (its findings are reported, with the seed
    that replays it). A batch is added one driver call per fault (a real P prefills each call's
    requests in one command), each request still armed on its own. Runs in the tp1 layout only
    (the layouts' own scenarios cover TP 2 and two groups)."""
    scenario.require("remote_prefill", "async_load")
    # At TP 2 with two groups every request costs P and D twice the blocks and a real
    # pair's rank processes; the soak's sums do not depend on the layout, its time does.
    scenario.require_layout("tp1")
    seed = scenario.seed_value
    rng = random.Random(seed)
    plan = soak_plan(scenario, rng, scenario.soak_batches or SOAK_BATCHES)
    if all(p is None for p in plan):
        scenario.require_fault(*SOAK_FAILS, SOAK_FAILS_FALLBACK, FaultPoint.ABORT_WHILE_WAITING)
    scenario.note("soak_seed", seed)
    scenario.note("soak_plan", dict(Counter("success" if p is None else p.value for p in plan)))
    engine = scenario.engine()
    fault_of: dict[str, FaultPoint | None] = {}
    found: list[str] = []
    batches = 0
    rss: list[int | None] = []  # this process's RSS after each batch: reported, not judged
    for start in range(0, len(plan), SOAK_BATCH):
        batch = {scenario.rid("soak"): p for p in plan[start : start + SOAK_BATCH]}
        fault_of.update(batch)
        # All added before D steps, one batch; an abort is provoked later, not armed.
        armed = {r: None if p is FaultPoint.ABORT_WHILE_WAITING else p for r, p in batch.items()}
        add_by_fault(scenario, engine, armed)
        blocks = start_loads(scenario, engine, list(batch))
        for rid, point in batch.items():
            if point is None:
                scenario.driver.settle(engine, rid)
            elif point is FaultPoint.ABORT_WHILE_WAITING:
                scenario.driver.provoke(engine, rid, point)
                scenario.driver.settle(engine, rid)  # the load itself still ends
            else:
                scenario.driver.provoke(engine, rid, point)
        batches += 1
        drained = scenario.run(engine).ok
        rss.append(_rss_kib())
        # Now, before later batches reuse these blocks (a report naming them then is theirs).
        found += not_late(engine, blocks)
        if not drained:
            break
    scenario.note("soak_batches", batches)
    if len(rss) > 1 and None not in rss:  # D's memory after the first batch vs the last
        scenario.note("soak_rss_growth_kib", rss[-1] - rss[0])
    rids = list(fault_of)
    good = [rid for rid in rids if fault_of[rid] is None]
    bad = [rid for rid in rids if fault_of[rid] not in (None, FaultPoint.ABORT_WHILE_WAITING)]
    aborted = [rid for rid in rids if fault_of[rid] is FaultPoint.ABORT_WHILE_WAITING]
    found += scenario.violations(engine, rids, failed=None, policy_outcome=False)
    found += wrong_bytes(scenario, engine, bad)
    if engine.crashed is None:
        for rid in good:
            found += oracles.check_policy_outcome(engine, rid, failed=False)
        for rid in bad:
            found += oracles.check_policy_outcome(engine, rid, failed=True)
    found += [
        f"C8 false failure: {rid} loaded well but a failure reached the scheduler at "
        f"step(s) {steps}"
        for rid, steps in sorted(failed_at(engine, good).items())
    ]
    if scenario.caps.byte_verification:
        for rid in good:
            mismatch = scenario.driver.verify_bytes(engine, rid)
            if mismatch:
                found.append(f"C1 wrong bytes for a successful load in the soak: {mismatch}")
    for rid in aborted:
        found += reports_after_free(engine, rid)
    if found:
        # The seed decides the plan, the request ids and so the prompts: the same run again.
        replay = (
            f"soak seed {seed}: replay with --kvfail-seed {seed} -k soak --connector "
            f"{scenario.node.callspec.params['kvfail_connector'] if scenario.node else '...'} "
            f"--policy {scenario.policy} --layout {scenario.layout.name}"
        )
        raise scenario.violation(list(dict.fromkeys(found)), evidence=[replay])
