"""Quarantine scenarios: a failed load's blocks stay out of reach while its transfer may
still write into them.

Why: a deadline ends a load whose P does not answer, but D cannot tell a dead P from a
slow one. A slow P may still write into the blocks D gave the load, after D gave up on
it: Mooncake's P pushes into D's memory whenever it gets to the pull, a NIXL READ posted
to a stopped P completes when P goes on. If the scheduler has meanwhile handed those
blocks to another request, that request runs on wrong KV, silently. Failing fast is only
safe if the blocks are not freed until the write is over (or cannot happen); and they
must come back then, or every slow P leaks blocks for good.

The scenario does what D's scheduler does after a failure: it hands the freed blocks to
other requests at once (vLLM reuses freed blocks last-in, first-out), and steps them while
the slow P's write lands. The KV-integrity oracle (``kvfail.peers.integrity``) checks every
position those requests computed at each of their steps, so a late write into reused
blocks is named (``C11 wrong KV``); one into freed blocks nobody took breaks their poison
(``C11 write after release``); blocks that never come back are a ``C11 leak``.
Requirements are capabilities and fault points, never connector names; every wait is
bounded, and no timing is asserted but the declared deadline's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance import timebase
from kvfail.conformance.report_timing import check_not_late, deadline_findings, declared_text
from kvfail.conformance.suite import HELD_BLOCKS_WAIT_S, MIN_STEPS, REAL_BUDGET_S, ScenarioContext
from kvfail.faults.points import FaultPoint
from kvfail.harness import oracles

# The clauses each scenario cites (@pytest.mark.clauses) are defined in docs/contract.md.
pytestmark = pytest.mark.vllm

#: The slow load's prompt: four blocks loaded (block size 32), small enough that it, the
#: fillers and a quarantine of its blocks fit D's 63 usable blocks with two groups.
PROMPT_LEN = 136
#: Tokens the slow request generates. Under ``recompute`` it runs on after its failure,
#: on the blocks the scheduler gave it (the same ones, where a failure names its blocks):
#: paced at FILL_POLL_S, it is still running, and checked, when the late write lands.
MAX_TOKENS = 100
#: Requests D computes itself, added right after the slow load failed, each as long as
#: the slow one: together they take every block the scheduler freed (LIFO reuse).
FILLERS = 2
#: A filler runs until the scenario aborts it after the late write (at FILL_POLL_S a
#: step this is over ten seconds of steps, more than LATE_WRITE_WAIT_S allows).
FILLER_MAX_TOKENS = 200
#: Sleep between D's steps while the fillers wait for the late write: paces the steps so
#: the fillers' tokens (and blocks) last; a bound set here, never asserted.
FILL_POLL_S = 0.05
#: D steps after the late write, so every filler is checked on what it now holds.
POST_WRITE_STEPS = 5
#: Bound on waiting for the slow P's late write once the fillers are in.
LATE_WRITE_WAIT_S = 10.0
#: Bound on the last steps, until D is idle: every request ended (the slow one's remaining
#: tokens) and no block held back. Blocks still held then are waited for once more, within
#: the suite's own bound (``HELD_BLOCKS_WAIT_S``, shared with the leak oracle's wait): a
#: connector that holds blocks for a transfer must learn that the transfer is over
#: (completion, P dead, P's expiry) and let them go.
DRAIN_S = 30.0


def _step_until(
    scenario: ScenarioContext,
    engine: Any,
    done: Callable[[Any], bool],
    *,
    timeout_s: float,
    poll_s: float,
    min_steps: int = 0,
) -> Any:
    """Step D until ``done(engine)``, bounded by ``timeout_s``; the driver observes each
    step (timestamps, the integrity oracle's release watch, a toy P's late write)."""
    driver = scenario.driver

    def predicate(e: Any) -> bool:
        driver.observe(e)
        return done(e)

    return engine.run_until(
        predicate, max_steps=1_000_000, timeout_s=timeout_s, poll_s=poll_s, min_steps=min_steps
    )


def _blocks_of(engine: Any, rids: list[str]) -> set[tuple[int, int]]:
    """(KV-cache group, block id) of every block these requests hold now."""
    sched = engine.scheduler
    return {
        (g, b)
        for rid in rids
        if rid in sched.requests
        for g, ids in enumerate(sched.kv_cache_manager.get_block_ids(rid))
        for b in ids
    }


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#21570", "aws-do-eks#84", "#35943")
def test_slow_peer_writes_after_deadline(scenario: ScenarioContext) -> None:
    """One load from a slow but ALIVE P that answers, and writes into D's blocks, only
    after the deadline D's connector declares (``slow_peer_past_deadline``). D loads once
    first (warm), so the transfer itself is what is late.

    The load must be reported failed by the declared deadline (+ a margin); a connector
    declaring a deadline that P's answer comes after must not turn it into a success, and
    one declaring none is a ``C10 no deadline`` here however quickly P answered (only P
    ended the load, so the verdict does not depend on P beating the suite's wait).
    Right after the failure reaches the scheduler, ``FILLERS`` requests D computes itself
    are added on the same D: without a hold on the failed load's blocks they get the ones
    the scheduler freed (``fail``), or the failed request runs on in them (``recompute``),
    and D steps them all until P's late write has landed. Then: no request may have run
    on bytes it did not compute or load (the integrity oracle, every step), no freed block
    may have been written (its poison), and once every request ended, D's free block
    count must come back to what it was before the load (``C11 leak`` otherwise), within
    a bounded wait while D steps; every other oracle holds too."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.SLOW_PEER_PAST_DEADLINE)
    _late_write_after_failure(scenario, point, "slow-past-deadline", answers=True)


@pytest.mark.clauses("C1", "C2", "C10", "C11")
@pytest.mark.guards("#35943")
def test_p_shutdown_mid_write(scenario: ScenarioContext) -> None:
    """P shuts down gracefully while its write into D's blocks is under way
    (``peer_shutdown_mid_write``): vLLM's shutdown path closes P's side channel at once
    and leaves the write to finish, so P never answers, and the write lands seconds
    later. A closed side channel is therefore no proof that P stopped writing. Once the
    write has landed the shutdown is over and P's process exits, as vLLM's does: a
    connector may take that exit, or P's own word, as the end of the write.

    The load must be reported failed (a connector may notice the closed channel, or its
    deadline ends the load); then the same checks as for a slow P: the blocks the failure
    freed are handed to fillers and stepped until the write has landed, and no request
    may run on bytes it did not compute or load, no freed block may be written, and the
    blocks must come back once the write is over."""
    scenario.require("remote_prefill", "async_load")
    point = scenario.require_fault(FaultPoint.PEER_SHUTDOWN_MID_WRITE)
    _late_write_after_failure(scenario, point, "shutdown-mid-write", answers=False)


def _late_write_after_failure(
    scenario: ScenarioContext, point: FaultPoint, name: str, *, answers: bool
) -> None:
    """One warm load whose P writes into D's blocks late, after D must have failed it:
    a P that ``answers`` once its late write is done (slow), or one that never answers
    (shut down). See the two scenarios above for the checks."""
    engine = scenario.engine(deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    delay = scenario.driver.slow_peer_delay_s
    p_what = "slow P's" if answers else "shut-down P's"
    # A slow P answers past the deadline (the toy's P only after the load stopped
    # waiting): a connector that enforces the deadline it declares fails the load. A P
    # shut down never answers: only a failure can end the load.
    must_fail = not answers or delay is None or (deadline is not None and deadline < delay)
    scenario.warm_up(engine)
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    # Nothing ends this scenario before P's late write: a wait no connector can save.
    scenario.wait_floor(delay if delay is not None else (deadline or 0.0))
    rid = scenario.rid(name)
    blocks = scenario.add_loading(
        engine, rid, fault=point, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS
    )
    mine = _blocks_of(engine, [rid])  # what it holds while it waits, per group
    poll_s = scenario.driver.poll_s or 0.01
    budget = scenario.deadline_budget(deadline)
    _step_until(
        scenario,
        engine,
        lambda e: rid not in e.waiting_for_remote(),
        timeout_s=budget,
        poll_s=poll_s,
        min_steps=MIN_STEPS,
    )
    found: list[str] = []
    seconds = scenario.driver.detection_s(engine, rid)
    if seconds is not None:
        scenario.note("detected_s", round(seconds, 3))
    stranded = rid in engine.waiting_for_remote()
    failed = rid in oracles.failed_requests(engine)
    found += deadline_findings(
        [rid], [rid] if stranded else [], [] if seconds is None else [seconds], deadline, budget
    )
    if answers and deadline is None and not failed and not stranded:
        # Stranded, it is already "C10 no deadline" above. Answered, it would pass or fail
        # by whether this P was quicker than the suite's wait: a verdict the machine's
        # speed would decide. Nothing but P ended the load, whatever P's speed.
        found.append(
            f"C10 no deadline: {rid} was ended by its slow P's answer, not by the "
            f"connector, which {declared_text(deadline)}: nothing bounds a load whose P "
            "is slower than this one"
        )
    if not stranded and must_fail and not failed:
        if not answers:
            found.append(
                f"C1 success without an answer: {rid} was reported loaded although its P "
                "shut down before it answered"
            )
        elif deadline is not None and seconds is not None:
            found.append(
                f"C10 deadline not enforced: {rid} succeeded {seconds:.1f} s after it was "
                f"added, once its slow P answered ({delay:g} s); the connector "
                f"{declared_text(deadline)}"
            )
    if not stranded and engine.crashed is None:
        fillers = [scenario.rid("filler") for _ in range(FILLERS)]
        for filler in fillers:
            scenario.driver.add_local_request(
                engine, filler, prompt_len=PROMPT_LEN, max_tokens=FILLER_MAX_TOKENS
            )
        landed: list[str] = []
        reused: set[tuple[int, int]] = set()

        def written(e: Any) -> bool:
            reused.update(mine & _blocks_of(e, fillers))
            late = scenario.driver.late_write_finding(e, rid)
            if late is not None:
                landed.append(late)
            return late is not None

        _step_until(
            scenario,
            engine,
            written,
            timeout_s=timebase.scaled(LATE_WRITE_WAIT_S),
            poll_s=FILL_POLL_S,
            min_steps=MIN_STEPS,  # a step-driven late write (the toy) is not starved by load
        )
        if landed:
            scenario.note("late_write", landed[0])
            after = engine.record.steps + POST_WRITE_STEPS
            _step_until(
                scenario,
                engine,
                lambda e: e.record.steps >= after,
                timeout_s=timebase.scaled(REAL_BUDGET_S),
                poll_s=FILL_POLL_S,
            )
        else:
            found.append(
                f"C11 setup: the {p_what} late write for {rid} did not happen within "
                f"{timebase.scaled(LATE_WRITE_WAIT_S):g} s of the fillers' start: "
                "nothing was written late"
            )
        # Report only: how many of the load's blocks the fillers got (none with a hold).
        scenario.note("reused_blocks", len(reused))
        if engine.crashed is None:
            running = [f for f in fillers if f in engine.scheduler.requests]
            if running:
                engine.abort(running)
        # Until D is idle: every request ended and the connector holds nothing back
        # (a hold keeps vLLM stepping D, through has_pending_push_work).
        _step_until(
            scenario,
            engine,
            lambda e: e.is_idle(),
            timeout_s=timebase.scaled(DRAIN_S),
            poll_s=poll_s,
        )
    if engine.crashed is None and not engine.scheduler.requests:
        back = scenario.await_held_blocks(engine, free_before)
        free, idle = back.free, back.idle
        scenario.note("blocks_back_s", round(back.waited_s, 3))
        if free < free_before and idle:
            found.append(
                f"C11 leak: {free_before - free} blocks held while D went idle, after every "
                f"request ended and the {p_what} write was over ({free} free, {free_before} "
                "before the load): vLLM does not step an engine with no requests unless "
                "its connector has pending work (has_pending_push_work), so they come back "
                "only with the next request, if then"
            )
        elif free < free_before:
            found.append(
                f"C11 leak: {free_before - free} blocks never returned to the free pool "
                f"within {timebase.scaled(HELD_BLOCKS_WAIT_S):g} s after every request ended and "
                f"the {p_what} write was over ({free} free, {free_before} before the load)"
            )
    found += check_not_late(engine, rid, blocks)
    if scenario.caps.byte_verification:
        wrong = scenario.driver.wrong_bytes_finding(engine, rid)
        if wrong is not None:
            found.append(f"C1 wrong bytes reported as success: {wrong}")
    expect = True if must_fail and (failed or stranded) else None
    scenario.check(engine, [rid], failed=expect, extra=found)
