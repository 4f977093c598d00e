"""How a scenario's wall-clock run ends (``ScenarioContext.run``).

The clock bounds the connector's time only: while a load waits for its report. Once
every load is reported, what is left (a recompute, the decode steps) is the scheduler's
own work, bounded by a step count, so a loaded machine that steps slowly cannot turn a
correct connector's scenario into a liveness violation. A wall-clock budget of almost
nothing stands for such a machine; the toy connector (in-process) plays D.

Also here: a warm-up (a scenario's precondition) that never loads fails with the rig's
state as evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.suite import (
    ACTIVE_BUDGET,
    MIN_STEPS,
    ConformanceViolation,
    ScenarioContext,
)
from kvfail.conformance.toy_driver import ToyDriver
from kvfail.faults.points import FaultPoint

pytestmark = pytest.mark.vllm

#: A wall-clock budget no step fits in: every run ends its timed part at MIN_STEPS.
NO_TIME_S = 1e-6


@pytest.fixture
def ctx() -> Iterator[ScenarioContext]:
    driver = ToyDriver()
    driver.start()
    context = ScenarioContext(
        driver=driver, caps=driver.capabilities(), policy="recompute", scenario="run-budget"
    )
    yield context
    context.close()
    driver.stop()


def _failed_load(ctx: ScenarioContext, max_tokens: int) -> Any:
    """A request whose load P answered with an error: recompute runs it locally."""
    engine = ctx.engine()
    ctx.add_loading(engine, "r", max_tokens=max_tokens)
    ctx.driver.provoke(engine, "r", FaultPoint.PEER_ERROR_RESPONSE)
    return engine


def test_after_every_report_the_run_goes_on_in_steps(ctx: ScenarioContext) -> None:
    engine = _failed_load(ctx, max_tokens=MIN_STEPS + 10)  # more decode steps than MIN_STEPS
    result = ctx.run(engine, timeout_s=NO_TIME_S)
    assert result.ok, result
    assert MIN_STEPS < result.steps <= MIN_STEPS + ACTIVE_BUDGET["max_steps"], result


def test_the_steps_after_the_reports_are_bounded(ctx: ScenarioContext) -> None:
    engine = _failed_load(ctx, max_tokens=MIN_STEPS + ACTIVE_BUDGET["max_steps"] + 20)
    result = ctx.run(engine, timeout_s=NO_TIME_S)
    assert (result.ok, result.reason) == (False, "max_steps"), result
    assert result.steps == MIN_STEPS + ACTIVE_BUDGET["max_steps"], result


def test_a_load_still_unreported_ends_the_run_on_the_clock(ctx: ScenarioContext) -> None:
    """A P that never answers (no deadline here): the clock's verdict, no extra steps."""
    engine = ctx.engine()
    ctx.add_loading(engine, "r", fault=FaultPoint.FREEZE_PEER)
    result = ctx.run(engine, timeout_s=NO_TIME_S)
    assert (result.ok, result.reason, result.steps) == (False, "timeout", MIN_STEPS), result
    assert "r" in engine.waiting_for_remote()


def test_a_warm_up_that_never_loads_carries_the_rig_state(
    ctx: ScenarioContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed precondition is a violation with evidence: what the driver sees of the
    loads (its ``stuck_state``) and the machine's busiest processes, so a warm-up that
    failed on a starved or busy peer shows it."""
    driver: Any = ctx.driver
    monkeypatch.setattr(
        driver, "settle", lambda e, rid: driver.provoke(e, rid, FaultPoint.PEER_ERROR_RESPONSE)
    )
    asked: list[list[str]] = []
    monkeypatch.setattr(driver, "stuck_state", lambda e, rids: asked.append(rids) or ["P: idle"])
    failing = ScenarioContext(driver=driver, caps=ctx.caps, policy="fail", scenario="warm-up")
    try:
        with pytest.raises(ConformanceViolation) as raised:
            failing.warm_up(failing.engine(), tries=2)
    finally:
        failing.close()
    assert len(asked) == 1 and asked[0][0].startswith("warmup-"), asked
    assert raised.value.violations[0].startswith("warm-up load (2 tries): C"), raised.value
    assert raised.value.evidence[-2] == "P: idle", raised.value.evidence
    assert raised.value.evidence[-1].startswith("busiest processes: "), raised.value.evidence


def test_a_load_that_never_starts_on_a_crash_shows_the_crash(
    ctx: ScenarioContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setup step that only sees ``reason='crash'`` (a load that never entered
    WAITING_FOR_REMOTE_KVS) carries where the engine crashed, with its traceback."""
    engine = ctx.engine()

    def broken_schedule() -> Any:
        raise RuntimeError("scheduler broke while planning a load")

    monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
    with pytest.raises(ConformanceViolation) as raised:
        ctx.add_loading(engine, ctx.rid("crashes"))
    assert "never entered WAITING_FOR_REMOTE_KVS" in raised.value.violations[0]
    crash = [e for e in raised.value.evidence if e.startswith("[engine 0 crash]")]
    assert crash[0].startswith("[engine 0 crash] RuntimeError in schedule at step"), crash
    assert crash[-1].endswith("RuntimeError: scheduler broke while planning a load"), crash
