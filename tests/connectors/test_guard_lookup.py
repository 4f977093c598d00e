"""The guard's bounded lookups and its memory of failed loads.

:class:`connectors.guard.lookup.BoundedCalls` alone, then the guard on vLLM's real
Scheduler (``kvfail.harness``) around the toy (a double at the transport boundary) made
to hang in its lookup (:class:`GatedLookupToy`) or to re-advertise a load that failed
(``toy_readvertise``, the #55297 loop). Over a real store: ``--connector
guard:vllm:MooncakeStoreConnector`` in the conformance suite (docs/guard.md).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

pytest.importorskip("vllm", reason="the guard is a vLLM connector")

from vllm.v1.request import RequestStatus

from connectors.guard.lookup import BoundedCalls
from kvfail.harness import oracles
from kvfail.harness.toy import ToyConnector
from tests.harness import conftest as harness_fixtures

# The harness tests' fixtures: a session's first config built once, engines closed after.
harness = harness_fixtures.harness
make_engine = harness_fixtures.make_engine
pytestmark = pytest.mark.vllm

WAIT_S = 10.0  # the bound on every wait below (never asserted as a time)


def _until(cond: Callable[[], bool]) -> bool:
    end = time.monotonic() + WAIT_S
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


# ---------------------------------------------------------------- BoundedCalls alone


def test_a_call_in_time_gives_its_value_and_its_exception() -> None:
    calls = BoundedCalls("inner", deadline_s=WAIT_S)
    try:
        outcome = calls.call("lookup", lambda: (16, True))
        assert outcome.done and outcome.value == (16, True)

        def boom() -> None:
            raise RuntimeError("inner broke")

        with pytest.raises(RuntimeError, match="inner broke"):
            calls.call("lookup", boom)
        assert calls.stuck is None
    finally:
        calls.close()


def test_a_stuck_call_opens_the_breaker_until_it_returns(caplog: Any) -> None:
    gate = threading.Event()
    calls = BoundedCalls("inner", deadline_s=0.05)
    asked: list[str] = []
    try:
        with caplog.at_level("WARNING", logger="kvfail.guard"):
            first = calls.call("lookup(a)", lambda: gate.wait(WAIT_S) and (16, True))
        assert not first.done and first.timed_out
        assert calls.stuck == "lookup(a)"
        assert [r for r in caplog.records if "lookup(a)" in r.getMessage()]
        # Refused at once, without asking the inner.
        second = calls.call("lookup(b)", lambda: asked.append("b"))
        assert not second.done and not second.timed_out and asked == []
        gate.set()
        assert _until(lambda: calls.stuck is None)
        # The stuck call's value went nowhere; the next call reaches the inner again.
        third = calls.call("lookup(c)", lambda: asked.append("c") or (0, False))
        assert third.done and third.value == (0, False) and asked == ["c"]
    finally:
        gate.set()
        calls.close()


# ---------------------------------------------------------------- on the real Scheduler

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 400, "timeout_s": 20.0}


class GatedLookupToy(ToyConnector):
    """The toy whose lookup of a request named ``stuck*`` waits for :attr:`GATE`, as a
    lookup waits on a frozen store master. :attr:`ASKED` lists every lookup it got."""

    GATE = threading.Event()
    ASKED: ClassVar[list[str]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        GatedLookupToy.ASKED.append(request.request_id)
        if request.request_id.startswith("stuck"):
            GatedLookupToy.GATE.wait(WAIT_S)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def _count_events(engine: Any) -> Counter[str]:
    """Every count the guard's scheduler half puts in its stats from now on (vLLM's
    scheduler takes them each step)."""
    guard = engine.scheduler.connector
    own = guard._guard_own_stats
    seen: Counter[str] = Counter()

    def spy() -> Any:
        stats = own()
        if stats is not None:
            seen.update({k.removeprefix("kvfail."): v for k, v in stats.data.items()})
        return stats

    guard._guard_own_stats = spy
    return seen


def test_a_stuck_lookup_is_answered_nothing_to_load_and_never_loads_later(
    harness: Any, make_engine: Callable[..., Any], caplog: Any
) -> None:
    GatedLookupToy.GATE.clear()
    GatedLookupToy.ASKED.clear()
    engine = make_engine(
        engine_id="GL-stuck",
        connector="KvfailGuardConnector",
        connector_module="connectors.guard",
        extra_config={
            "inner": f"{__name__}:GatedLookupToy",
            "inner_extra_config": {"toy_mode": "complete"},
            "lookup_deadline_s": 0.2,
        },
    )
    guard = engine.scheduler.connector
    inner = guard._guard_inner
    worker = engine.workers[0].connector
    events = _count_events(engine)
    try:
        with caplog.at_level("WARNING", logger="kvfail.guard"):
            stuck = engine.add_request("stuck", kv_transfer_params=PD, max_tokens=40)
            engine.step()
        # Answered "nothing to load": scheduled to compute its prompt, no load promised.
        assert stuck.status == RequestStatus.RUNNING
        assert "stuck" not in inner._pending_loads
        assert sum("did not return" in r.getMessage() for r in caplog.records) == 1
        # While the lookup hangs, another request is answered at once: the inner is
        # not asked.
        other = engine.add_request("other", kv_transfer_params=PD, max_tokens=2)
        engine.step()
        assert "other" not in GatedLookupToy.ASKED
        assert other.status == RequestStatus.RUNNING
        guard.get_kv_connector_stats()
        assert events["lookups_timed_out"] == 1 and events["lookups_refused_stuck"] >= 1
        # The hung lookup returns while "stuck" still runs: its hit is dropped, and no
        # step after announces a load for it.
        GatedLookupToy.GATE.set()
        assert _until(lambda: guard._lookups.stuck is None)
        assert engine.run_until_idle(**BUDGET).ok
        assert stuck.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert "stuck" not in inner._advertised
        assert worker.failure_stats().as_dict()["loads_tracked"] == 0
        assert oracles.check_all(engine) == []
        # The breaker is closed: a new request loads through the inner again.
        after = engine.add_request("after", kv_transfer_params=PD, max_tokens=2)
        assert engine.run_until_idle(**BUDGET).ok
        assert "after" in GatedLookupToy.ASKED
        assert after.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert worker.failure_stats().as_dict()["loads_succeeded"] == 1
    finally:
        GatedLookupToy.GATE.set()


@pytest.mark.parametrize("guarded_run", [True, False], ids=["guarded", "alone"])
def test_a_failed_load_is_not_offered_again_to_its_recompute(
    harness: Any, make_engine: Callable[..., Any], guarded_run: bool
) -> None:
    """The inner re-advertises a load that failed (``toy_readvertise``, #55297). Alone
    (the negative control) the recompute loads again; guarded it computes locally."""
    toy = {"toy_mode": "hold", "toy_readvertise": True}
    if guarded_run:
        engine = make_engine(
            engine_id="GL-c12-g",
            connector="KvfailGuardConnector",
            connector_module="connectors.guard",
            extra_config={"inner": "kvfail.harness.toy:ToyConnector", "inner_extra_config": toy},
            policy="recompute",
        )
        inner = engine.workers[0].connector._guard_inner
    else:
        engine = make_engine(
            engine_id="GL-c12-a",
            connector="ToyConnector",
            connector_module="kvfail.harness.toy",
            extra_config=toy,
            policy="recompute",
        )
        inner = engine.workers[0].connector
    events = _count_events(engine) if guarded_run else Counter()
    req = engine.add_request("again", kv_transfer_params=PD, max_tokens=2)
    engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    inner.fail("again")
    for _ in range(6):
        engine.step()
        if req.is_finished() or req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    if not guarded_run:
        # The loop: the same request waits on a second load from the source that failed.
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        inner.complete("again")
        return
    assert engine.run_until_idle(**BUDGET).ok
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    engine.scheduler.connector.get_kv_connector_stats()
    assert events["loads_refused_failed_before"] == 1
    assert engine.workers[0].connector.failure_stats().as_dict()["loads_tracked"] == 1
    assert oracles.check_all(engine, failed=True) == []
