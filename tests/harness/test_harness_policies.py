"""The harness against vLLM's real Scheduler, one KV-cache group, TP=1.

Each test proves one thing the harness must show faithfully: a good load completes and
frees everything, a failure follows the configured policy, a connector that never reports
is caught by the liveness oracle within the step budget (not by hanging), and a report
for an unknown id is recorded as the crash it would be in a real engine (C7).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvfail import Stage
from kvfail.harness import EngineCrashedError, oracles
from kvfail.harness import engine as engine_module
from tests.core.fakes import ManualClock

pytestmark = pytest.mark.vllm

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 40, "timeout_s": 10.0}


def _poll_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's clock moves only by its own ``poll_s`` sleeps, so where a timeout ends
    a run is a step count, whatever the machine's load."""
    clock = ManualClock()
    monkeypatch.setattr(
        engine_module, "time", SimpleNamespace(monotonic=clock, sleep=clock.advance)
    )


def _held_on_poll_clock(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch, engine_id: str, request_id: str
) -> Any:
    """D with one load the toy holds until told, on :func:`_poll_clock`: only the run's
    own bounds can end its run, at a step count the test can name."""
    engine = make_engine(engine_id=engine_id, extra_config={"toy_mode": "hold"})
    engine.add_request(request_id, kv_transfer_params=PD)
    _poll_clock(monkeypatch)
    return engine


def test_import_kvfail_does_not_import_harness_or_vllm() -> None:
    code = (
        "import sys, kvfail; "
        "bad = [m for m in ('kvfail.harness', 'vllm', 'torch') if m in sys.modules]; "
        "sys.exit(repr(bad) if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_config_is_what_a_real_worker_needs(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-cfg")
    vc = engine.vllm_config
    assert vc.cache_config.kv_cache_layout == "LBHNC"
    assert vc.cache_config.num_gpu_blocks == 64
    assert vc.kv_transfer_config.kv_role == "kv_consumer"
    assert vc.model_config.get_head_size() == 64
    caches = engine.workers[0].kv_caches
    assert sorted(caches) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    for cache in caches.values():
        # [blocks, kv heads, tokens per block, K and V packed]: vLLM's own allocator.
        assert tuple(cache.shape) == (64, 2, 32, 128)
        assert (
            cache[0].nbytes
            == engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        )
    assert engine.workers[0].connector.kv_caches.keys() == caches.keys()


def test_successful_async_load_completes_and_frees_everything(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-ok", extra_config={"toy_mode": "hold"})
    req = engine.add_request("ok", prompt_len=100, max_tokens=3, kv_transfer_params=PD)
    engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == 96  # (100 - 1) rounded down to 32-token blocks
    assert engine.workers[0].connector.inflight() == {"ok"}
    engine.workers[0].connector.complete("ok")
    result = engine.run_until_idle(**BUDGET)
    assert result.ok, result
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    tokens = [t for o in engine.record.outputs_for("ok") for t in o.new_token_ids]
    assert len(tokens) == 3
    assert oracles.check_all(engine) == []


def test_fail_policy_block_level_failure_errors_once_without_leak(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-fail", policy="fail", extra_config={"toy_mode": "hold"})
    engine.add_request("bad", kv_transfer_params=PD)
    engine.step()
    engine.workers[0].connector.fail("bad", block_index=1, stage=Stage.PEER)
    engine.step()
    seen = engine.record.scheduler_reports()[-1]
    assert seen.finished_recving == {"bad"} and seen.invalid_block_ids  # paired (C2/C3)
    assert engine.status("bad") == RequestStatus.FINISHED_ERROR
    assert engine.run_until_idle(**BUDGET).ok
    errors = [o for o in engine.record.outputs if o.finish_reason == FinishReason.ERROR]
    assert [o.request_id for o in errors] == ["bad"]
    assert oracles.check_all(engine, failed=True) == []


def test_recompute_policy_rewinds_to_first_bad_block_and_completes(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-rec", policy="recompute", extra_config={"toy_mode": "hold"})
    req = engine.add_request("rec", prompt_len=100, max_tokens=2, kv_transfer_params=PD)
    engine.step()
    engine.workers[0].connector.fail("rec", block_index=2)
    engine.step()
    assert req.num_computed_tokens == 2 * 32  # valid prefix: blocks 0 and 1
    step = engine.step()
    assert req.status == RequestStatus.RUNNING
    assert step.num_scheduled_tokens == 100 - 64
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_all(engine, failed=True) == []


def test_silent_connector_is_caught_by_liveness_oracle_within_budget(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-stall", extra_config={"toy_mode": "hold"})
    engine.add_request("stuck", kv_transfer_params=PD)
    result = engine.run_until_idle(max_steps=25, timeout_s=5.0)
    assert not result.ok and result.reason == "max_steps" and result.steps == 25, result
    liveness = oracles.check_liveness(engine)
    assert len(liveness) == 1 and liveness[0].startswith("C2/C10 liveness: stuck")
    assert "3 blocks held" in liveness[0]
    assert any("free blocks" in v for v in oracles.check_no_leaks(engine))
    # A late report still releases it: the harness did not hang and state is consistent.
    engine.workers[0].connector.complete("stuck")
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_all(engine) == []


def test_wall_clock_bound_applies_even_when_steps_remain(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _held_on_poll_clock(make_engine, monkeypatch, "D-wall", "slow")
    result = engine.run_until_idle(max_steps=10_000, timeout_s=0.25, poll_s=0.0625)
    # Four polls fill the timeout: the clock, not the step budget, ended the run.
    assert (result.reason, result.steps) == ("timeout", 4), result


def test_min_steps_outlasts_the_timeout_but_is_itself_bounded(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A starved process must still step D enough for a connector's drains to run; but a
    # step that never returns quickly cannot stretch the run past its timeout plus the cap.
    engine = _held_on_poll_clock(make_engine, monkeypatch, "D-min", "held")
    result = engine.run_until(lambda e: False, timeout_s=0.0, min_steps=7)
    assert (result.reason, result.steps) == ("timeout", 7), result
    result = engine.run_until(
        lambda e: False, timeout_s=0.25, min_steps=10**9, min_steps_cap_s=0.25, poll_s=0.0625
    )
    # Past the timeout (4 polls) min_steps kept it going; the cap ended it at 8 polls.
    assert (result.reason, result.steps) == ("timeout", 8), result


def test_reporter_deadline_turns_silence_into_a_reported_failure(make_engine: Any) -> None:
    # The toy's reporter has a deadline (C10): the harness must deliver the watchdog's
    # failure like any other, ending the request under `fail` instead of stalling.
    engine = make_engine(engine_id="D-wd", extra_config={"toy_mode": "hold", "toy_deadline_s": 0.1})
    engine.add_request("late", kv_transfer_params=PD)
    result = engine.run_until_idle(max_steps=200, timeout_s=5.0, poll_s=0.01)
    assert result.ok, result
    assert engine.status("late") == RequestStatus.FINISHED_ERROR
    stats = engine.workers[0].connector.failure_stats()
    assert stats["stage.watchdog"] == 1
    assert oracles.check_all(engine, failed=True) == []


def test_unknown_id_in_finished_recving_is_recorded_as_c7_crash(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-c7")
    engine.add_request("real", kv_transfer_params=PD, max_tokens=8)
    engine.step()
    engine.workers[0].connector.inject(finished_recving={"ghost"})
    step = engine.step()
    assert step.crash is not None
    assert step.crash.phase == "update_from_output"
    assert step.crash.exc_type == "AssertionError" and step.crash.clause == "C7"
    crash_msgs = oracles.check_no_crash(engine)
    assert len(crash_msgs) == 1 and crash_msgs[0].startswith("C7 crash")
    assert "ghost" in engine.record.scheduler_reports()[-1].finished_recving
    with pytest.raises(EngineCrashedError):
        engine.step()
    assert engine.run_until_idle(**BUDGET).reason == "crash"


def test_abort_while_waiting_holds_blocks_until_finished_recving(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-abort", extra_config={"toy_mode": "hold"})
    engine.add_request("gone", kv_transfer_params=PD)
    engine.step()
    assert engine.abort("gone") == ["gone"]
    engine.run_until_idle(max_steps=5)
    assert any(v.startswith("C9 liveness: gone") for v in oracles.check_liveness(engine))
    engine.workers[0].connector.complete("gone")
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_no_leaks(engine) == []
    assert [o.finish_reason for o in engine.record.outputs_for("gone")] == []


def test_readvertised_hit_after_failure_is_flagged(make_engine: Any) -> None:
    # Negative control for the #55297 oracle: an always-hitting connector under
    # `recompute` with every load failing loops load -> fail -> load.
    engine = make_engine(
        engine_id="D-loop",
        policy="recompute",
        extra_config={"toy_mode": "fail", "toy_readvertise": True},
    )
    engine.add_request("loop", kv_transfer_params=PD)
    result = engine.run_until_idle(max_steps=12, timeout_s=5.0)
    assert not result.ok
    assert engine.record.load_episodes("loop") > 1
    violations = oracles.check_no_readvertise_after_failure(engine)
    assert len(violations) == 1 and violations[0].startswith("C12 (#55297): loop")
    # The same connector without the re-advertising bug recovers by local prefill.
    fixed = make_engine(engine_id="D-noloop", policy="recompute", extra_config={"toy_mode": "fail"})
    fixed.add_request("loop", kv_transfer_params=PD)
    assert fixed.run_until_idle(**BUDGET).ok
    assert oracles.check_all(fixed, failed=True) == []


def test_transfer_group_build_path(make_engine: Any) -> None:
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    engine = make_engine(engine_id="D-tg", worker_build="transfer_group")
    assert has_kv_transfer_group()
    engine.add_request("tg", kv_transfer_params=PD)
    assert engine.run_until_idle(**BUDGET).ok
    assert oracles.check_all(engine) == []
    engine.close()
    assert not has_kv_transfer_group()


def test_exception_in_a_worker_hook_is_recorded_as_c13_crash(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(engine_id="D-c13")
    engine.add_request("r", kv_transfer_params=PD)

    def boom(finished_req_ids: set[str]) -> Any:
        raise ConnectionError("transport went away")

    monkeypatch.setattr(engine.workers[0].connector, "get_transfer_results", boom)
    step = engine.step()
    assert step.crash is not None and step.crash.phase == "worker[0]"
    assert step.crash.clause == "C13" and "transport went away" in step.crash.message
    assert oracles.check_no_crash(engine)[0].startswith("C13 crash")


def test_idle_engine_does_not_step_unless_forced(make_engine: Any) -> None:
    engine = make_engine(engine_id="D-idle")
    assert engine.is_idle()
    assert not engine.step().ran and engine.record.steps == 0
    forced = engine.step(force=True)
    assert forced.ran and forced.num_scheduled_tokens == 0 and engine.record.steps == 1
    assert oracles.check_all(engine) == []


def test_exception_in_the_forward_hook_is_not_blamed_on_the_connector(make_engine: Any) -> None:
    def bad_forward(engine: Any, worker: Any, so: Any) -> None:
        raise ValueError("bug in the test's forward")

    engine = make_engine(engine_id="D-fwd", forward=bad_forward)
    engine.add_request("local", max_tokens=1)
    step = engine.step()
    assert step.crash is not None and step.crash.phase == "forward[0]"
    assert step.crash.exc_type == "ValueError" and step.crash.clause == "crash"
