"""The harness's request-level mode: vLLM's real Scheduler as if block-level load-error
reporting were removed (vLLM PR #42461; :mod:`kvfail.harness.reporting`).

What must hold for the mode to judge anything: block ids are gone from every place the
scheduler could get them (the connector interface, the runner's output, the scheduler's
own path), kvfail's mixin sees that through its ordinary detection and reports by request
id, and the installed vLLM comes back whole when the last such engine closes.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvfail import Stage, compat
from kvfail.harness import oracles, reporting

pytestmark = pytest.mark.vllm

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 40, "timeout_s": 10.0}
METHOD = "get_block_ids_with_load_errors"


def _request_level(make_engine: Any, engine_id: str, **fields: Any) -> Any:
    return make_engine(
        engine_id=engine_id,
        reporting="request-level",
        extra_config={"toy_mode": "hold"},
        **fields,
    )


def test_the_switch_removes_block_level_reporting_from_the_schedulers_view(
    make_engine: Any,
) -> None:
    assert compat.routing(1).block_level  # the installed vLLM has it
    engine = _request_level(make_engine, "D-rl-view")
    # The interface: vLLM's base no longer declares it, and compat detects that.
    assert METHOD not in KVConnectorBase_V1.__dict__
    assert not compat.block_level_channel_available()
    assert compat.routing(1) == compat.Routing(
        request_level=True, block_level=False, why_not_blocks=compat.routing(1).why_not_blocks
    )
    assert "#42461" in compat.routing(1).why_not_blocks
    # The scheduler: a subclass of the real one, with its block-level path gone.
    scheduler = engine.scheduler
    assert isinstance(scheduler, Scheduler) and type(scheduler) is not Scheduler
    with pytest.raises(reporting.BlockLevelRemovedError):
        scheduler._handle_invalid_blocks({1}, {})
    output = ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={1}),
    )
    with pytest.raises(reporting.BlockLevelRemovedError):
        scheduler.update_from_output(scheduler.schedule(), output)
    # kvfail's mixin in the worker read the same interface: no block channel.
    tracker = engine.workers[0].connector.failure_reporter
    assert tracker.request_level and tracker.request_level_available


def test_a_narrowed_failure_goes_out_by_request_and_the_policy_fails_it(
    make_engine: Any,
) -> None:
    engine = _request_level(make_engine, "D-rl-fail", policy="fail")
    engine.add_request("bad", kv_transfer_params=PD)
    engine.step()
    # One block lost: on block level this is one invalid block; here there is none.
    engine.workers[0].connector.fail("bad", block_index=1, stage=Stage.PEER)
    engine.step()
    seen = engine.record.scheduler_reports()[-1]
    assert seen.finished_recving == {"bad"} and seen.failed_recving == {"bad"}
    assert not seen.invalid_block_ids
    assert engine.status("bad") == RequestStatus.FINISHED_ERROR
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_all(engine, failed=True) == []


def test_recompute_starts_from_no_computed_token(make_engine: Any) -> None:
    """#42461's recovery is a full recompute: the valid prefix a block report would have
    kept (block 0 here) is recomputed too."""
    engine = _request_level(make_engine, "D-rl-recompute", policy="recompute")
    req = engine.add_request("bad", prompt_len=100, max_tokens=2, kv_transfer_params=PD)
    engine.step()
    assert req.num_computed_tokens == 96
    engine.workers[0].connector.fail("bad", block_index=1, stage=Stage.PEER)
    engine.step()  # the report: the scheduler drops every computed token
    step = engine.step()  # the recompute: the whole prompt, from token 0
    assert step.num_scheduled_tokens == 100
    assert engine.run_until_idle(**BUDGET).ok
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert oracles.check_all(engine, failed=True) == []


def test_block_ids_a_connector_still_reports_never_reach_the_scheduler(
    make_engine: Any,
) -> None:
    """A connector that only names blocks has no channel left: the runner never asks it,
    so its failure is lost and the request waits (what the suite then flags)."""
    engine = _request_level(make_engine, "D-rl-blocks")
    engine.add_request("blk", kv_transfer_params=PD)
    engine.step()
    connector = engine.workers[0].connector
    connector.inject(finished_recving={"blk"}, invalid_block_ids={1, 2})
    engine.step()
    seen = engine.record.scheduler_reports()[-1]
    assert seen.finished_recving == {"blk"} and not seen.invalid_block_ids
    assert connector._raw_invalid == {1, 2}  # never asked for
    assert METHOD not in vars(connector)  # the runner's stand-in is gone after the step


def test_the_installed_vllm_comes_back_when_the_last_engine_closes(make_engine: Any) -> None:
    first = _request_level(make_engine, "D-rl-a")
    second = _request_level(make_engine, "D-rl-b")
    first.close()
    assert METHOD not in KVConnectorBase_V1.__dict__  # the second still runs
    second.close()
    assert METHOD in KVConnectorBase_V1.__dict__
    assert compat.routing(1).block_level


def test_one_mode_per_process(make_engine: Any) -> None:
    _request_level(make_engine, "D-rl-only")
    with pytest.raises(ValueError, match="one mode per process"):
        make_engine(engine_id="D-bl", reporting="block-level")


def test_the_environment_switches_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfail.harness import EngineSpec

    monkeypatch.delenv(reporting.ENV, raising=False)
    assert EngineSpec().reporting == "block-level"
    monkeypatch.setenv(reporting.ENV, "request-level")
    assert EngineSpec().reporting == "request-level"
    monkeypatch.setenv(reporting.ENV, "per-block")
    with pytest.raises(ValueError, match="KVFAIL_REPORTING"):
        EngineSpec()


def _rank_sees(view: Any) -> tuple[bool, bool, bool]:
    """On the rank: does the base declare block ids, does compat see them, does the
    rank's tracker report by request id."""
    tracker = view.connector.failure_reporter
    return (
        METHOD in KVConnectorBase_V1.__dict__,
        compat.routing(1).block_level,
        tracker.request_level,
    )


def _fail_one_block(view: Any, rid: str) -> None:
    view.connector.fail(rid, block_index=0)


def test_rank_processes_run_in_the_same_mode(make_engine: Any) -> None:
    """Real TP ranks (their own processes) take the mode from the spec, before their
    connector is built, and fail by request id; the aggregated report carries no block."""
    engine = make_engine(
        engine_id="D-rl-ranks",
        tp_size=2,
        tp_mode="processes",
        reporting="request-level",
        extra_config={"toy_mode": "hold"},
    )
    assert [w.call(_rank_sees) for w in engine.workers] == [(False, False, True)] * 2
    engine.add_request("bad", kv_transfer_params=PD)
    engine.step()
    for worker in engine.workers:
        worker.call(_fail_one_block, "bad")
    engine.step()
    seen = engine.record.scheduler_reports()[-1]
    assert seen.failed_recving == {"bad"} and not seen.invalid_block_ids
    assert engine.status("bad") == RequestStatus.FINISHED_ERROR
