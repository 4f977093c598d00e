"""The guard around an inner connector, on vLLM's real Scheduler (``kvfail.harness``).

The inner here is the toy (:mod:`kvfail.harness.toy`, a double at the transport
boundary), because these tests must make the inner silent, late, wrong or noisy exactly
when they say so. What they prove also runs over real transports: ``--connector
guard:vllm:MooncakeConnector`` (and NIXL) in the conformance suite (docs/guard.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the guard is a vLLM connector")

from vllm.v1.request import RequestStatus

from kvfail.harness import oracles
from tests.harness import conftest as harness_fixtures

# The harness tests' fixtures: a session's first config built once, engines closed after.
harness = harness_fixtures.harness
make_engine = harness_fixtures.make_engine

pytestmark = pytest.mark.vllm

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 400, "timeout_s": 20.0}
TOY = "kvfail.harness.toy:ToyConnector"


@pytest.fixture
def guarded(make_engine: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    def make(*, inner_extra: dict[str, Any] | None = None, **fields: Any) -> Any:
        extra = {
            "inner": TOY,
            "inner_extra_config": {"toy_mode": "hold", **(inner_extra or {})},
            "deadline_s": fields.pop("deadline_s", 30.0),
        }
        extra.update(fields.pop("guard", {}))
        return make_engine(
            connector="KvfailGuardConnector",
            connector_module="connectors.guard",
            extra_config=extra,
            **fields,
        )

    yield make


def _guard(engine: Any) -> Any:
    return engine.workers[0].connector


def _inner(engine: Any) -> Any:
    return _guard(engine)._guard_inner


def test_both_roles_wrap_the_inner_with_its_own_extra_config(guarded: Any) -> None:
    engine = guarded(engine_id="G-wrap", inner_extra={"toy_mode": "complete"})
    from connectors.guard import KvfailGuardConnector
    from kvfail.harness.toy import ToyConnector

    for connector in (engine.scheduler.connector, _guard(engine)):
        assert isinstance(connector, KvfailGuardConnector)
        assert isinstance(connector._guard_inner, ToyConnector)
        assert connector._guard_inner.mode == "complete"
    assert engine.scheduler.connector.kv_load_deadline_s == 30.0


def test_a_good_load_passes_through(guarded: Any) -> None:
    engine = guarded(engine_id="G-ok", inner_extra={"toy_mode": "complete"})
    req = engine.add_request("ok", kv_transfer_params=PD, max_tokens=2)
    assert engine.run_until_idle(**BUDGET).ok
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert oracles.check_all(engine) == []
    assert _guard(engine).failure_stats().as_dict()["loads_succeeded"] == 1


def test_deadline_counts_from_start_load_kv_not_admission(guarded: Any) -> None:
    engine = guarded(engine_id="G-start")
    engine.add_request("late-start", kv_transfer_params=PD)
    guard = _guard(engine)
    # Admitted and allocated by the scheduler, bound to the worker: not started yet.
    so = engine.scheduler.schedule()
    guard.bind_connector_metadata(so.kv_connector_metadata)
    assert not guard.failure_reporter.is_tracked("late-start")
    guard.start_load_kv(None)
    assert guard.failure_reporter.is_tracked("late-start")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_silent_inner_is_failed_at_the_deadline_and_held_until_it_reports(
    guarded: Any, policy: str
) -> None:
    engine = guarded(engine_id=f"G-dl-{policy}", policy=policy, deadline_s=0.2)
    req = engine.add_request("silent", kv_transfer_params=PD, max_tokens=2)
    result = engine.run_until(
        lambda _: req.is_finished(),
        max_steps=BUDGET["max_steps"],
        timeout_s=BUDGET["timeout_s"],
        poll_s=0.01,
    )
    assert result.ok
    expected = (
        RequestStatus.FINISHED_ERROR if policy == "fail" else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert req.status == expected
    assert _guard(engine).failure_stats().as_dict()["stage.watchdog"] == 1
    # The inner never said the load ended: its blocks stay out of the pool.
    quarantine = engine.scheduler.connector.quarantine
    assert quarantine is not None and quarantine.is_held("silent")
    # The inner reports it at last: the transfer is over, the blocks come back.
    _inner(engine).complete("silent")
    engine.run_until(lambda _: not quarantine.is_held("silent"), max_steps=20, timeout_s=10.0)
    assert not quarantine.is_held("silent")
    assert oracles.check_all(engine, failed=True) == []


def test_inner_failure_is_delivered_once_and_late_repeats_are_dropped(guarded: Any) -> None:
    engine = guarded(engine_id="G-once")
    req = engine.add_request("f", kv_transfer_params=PD, max_tokens=2)
    engine.step()
    _inner(engine).fail("f")
    engine.step()
    # The inner repeats itself, and names an id the scheduler never had.
    _inner(engine).inject(finished_recving={"f", "ghost"}, failed_recving={"f"})
    assert engine.run_until_idle(**BUDGET).ok
    assert req.status == RequestStatus.FINISHED_ERROR
    assert oracles.check_all(engine, failed=True) == []
    counts = _guard(engine).failure_stats().as_dict()
    assert counts["late_reports"] == 1 and counts["unknown_reports"] == 1


def test_unknown_failed_blocks_from_the_inner_are_dropped(guarded: Any) -> None:
    engine = guarded(engine_id="G-blocks", inner_extra={"toy_mode": "complete"})
    local = engine.add_request("local", max_tokens=3)
    engine.step()
    (blocks,) = engine.scheduler.kv_cache_manager.get_block_ids("local")
    _inner(engine).inject(invalid_block_ids={blocks[0]})
    assert engine.run_until_idle(**BUDGET).ok
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert oracles.check_all(engine) == []


def test_two_groups_block_level_report_becomes_request_level(guarded: Any) -> None:
    """Alone, this report raises in vLLM's scheduler (C5, see test_harness_tp_groups)."""
    engine = guarded(engine_id="G-g2", num_kv_cache_groups=2)
    req = engine.add_request("g", kv_transfer_params=PD, max_tokens=2)
    engine.step()
    block = engine.scheduler.kv_cache_manager.get_block_ids("g")[1][0]
    _inner(engine).inject(finished_recving={"g"}, invalid_block_ids={block})
    step = engine.step()
    assert step.crash is None
    seen = engine.record.scheduler_reports()[-1]
    assert seen.failed_recving == {"g"} and not seen.invalid_block_ids
    assert engine.run_until_idle(**BUDGET).ok
    assert req.status == RequestStatus.FINISHED_ERROR
    assert oracles.check_all(engine, failed=True) == []


def test_inner_start_load_kv_raising_fails_its_loads(guarded: Any) -> None:
    engine = guarded(engine_id="G-raise")
    inner = _inner(engine)

    def boom(*_: Any, **__: Any) -> None:
        raise RuntimeError("inner broke")

    inner.start_load_kv = boom
    req = engine.add_request("r", kv_transfer_params=PD, max_tokens=2)
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_no_crash(engine) == []
    assert req.status == RequestStatus.FINISHED_ERROR
    assert _guard(engine).failure_stats().as_dict()["stage.internal"] == 1


def test_bad_key_stops_the_engine_from_being_built(make_engine: Any) -> None:
    from connectors.guard import GuardConfigError

    with pytest.raises(GuardConfigError, match="'deadline_sec'"):
        make_engine(
            engine_id="G-bad",
            connector="KvfailGuardConnector",
            connector_module="connectors.guard",
            extra_config={"inner": TOY, "deadline_sec": 3},
        )


def test_deadline_failure_of_a_load_whose_p_refuses_is_not_held(guarded: Any) -> None:
    """P's advertised address refuses connections: proven gone, nothing to hold."""
    import socket

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    host, port = probe.getsockname()
    probe.close()
    engine = guarded(engine_id="G-gone", deadline_s=0.2)
    params = {**PD, "remote_bootstrap_addr": f"{host}:{port}"}
    req = engine.add_request("gone", kv_transfer_params=params, max_tokens=2)
    engine.run_until(lambda _: req.is_finished(), max_steps=400, timeout_s=20.0, poll_s=0.01)
    assert req.status == RequestStatus.FINISHED_ERROR
    quarantine = engine.scheduler.connector.quarantine
    assert quarantine is not None and not quarantine.is_held("gone") and quarantine.holds == 0
    assert oracles.check_all(engine, failed=True) == []
