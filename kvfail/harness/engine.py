"""Drive vLLM's real ``Scheduler`` on CPU and play the model runner around it.

Why: a connector's load-error behaviour only matters through what the real scheduler does
with its reports, and the scheduler needs no GPU. So :class:`Engine` builds the real
``vllm.v1.core.sched.scheduler.Scheduler`` (which builds the SCHEDULER-role connector
itself), builds one WORKER-role connector per simulated TP rank with real CPU KV tensors,
and plays the engine core and the model runner each step, in vLLM's order:

1. ``schedule()``;
2. per rank, with that rank's connector installed as the process's KV transfer group:
   ``handle_preemptions``, then vLLM's own ``KVConnectorModelRunnerMixin`` runs the worker
   hooks (``bind_connector_metadata``, ``start_load_kv`` before or after the forward,
   ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
   ``get_kv_connector_stats``, ... , ``clear_connector_metadata``) around our forward
   (an optional callback, e.g. a producer writing a byte pattern into its KV tensors);
   with nothing scheduled, the mixin's ``kv_connector_no_forward``, as the runner does;
3. a ``ModelRunnerOutput`` with one deterministic sampled token per request that finished
   its prefill or decoded (none for a partial prefill chunk);
4. TP > 1: vLLM's ``KVOutputAggregator``, built as the engine core builds it
   (``from_connector(scheduler.connector, world_size)``);
5. ``update_from_output``.

Everything the scheduler saw is recorded (:mod:`kvfail.harness.records`): each ``EngineCoreOutput``,
each rank's raw ``KVConnectorOutput`` and the aggregated one, which request ids were in
``WAITING_FOR_REMOTE_KVS`` after each ``schedule()``, and which requests each failure
report touched. An exception from a worker hook or from ``update_from_output`` (C7's
``assert req_id in self.requests``, C5's ``RuntimeError``) would kill a real EngineCore;
here it is recorded as a :class:`Crash` and the engine refuses further steps.

How each rank is built, in this process or in its own (``EngineSpec.tp_mode``), is
:mod:`kvfail.harness.workers`; prompts and sampled tokens are :mod:`kvfail.harness.requests`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvfail import compat
from kvfail.harness.config import BuiltConfig, EngineSpec, build_config
from kvfail.harness.hooks import (
    ForwardHookError,
    KVLayer,
    LayerAttentionMetadata,
    LayerContext,
    SplitForward,
    run_worker_hooks,
)
from kvfail.harness.ranks import RankCrash
from kvfail.harness.records import (
    Crash,
    EngineCrashedError,
    EngineRecord,
    KVReport,
    OutputRecord,
    RunResult,
    StepRecord,
)
from kvfail.harness.reporting import hold as hold_reporting
from kvfail.harness.reporting import scheduler_class
from kvfail.harness.requests import ensure_none_hash, new_request, prompt_tokens, sampled_token
from kvfail.harness.threads import set_harness_threads
from kvfail.harness.workers import (
    Worker,
    WorkerBuild,
    build_worker,
    ensure_world_of_one,
    installed_as_transfer_group,
    release_transfer_group,
    start_rank_processes,
)
from kvfail.rig.shm import release_shared_memory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["Engine", "ForwardHook", "rewriting_specs"]

#: Rewrites applied to every spec an :class:`Engine` is built from, innermost last (see
#: :func:`rewriting_specs`). Module-level, not a context variable: a driver may build its
#: engines in a helper thread.
_SPEC_REWRITES: list[Callable[[EngineSpec], EngineSpec]] = []


@contextlib.contextmanager
def rewriting_specs(rewrite: Callable[[EngineSpec], EngineSpec]) -> Iterator[None]:
    """Build every engine made meanwhile from ``rewrite(spec)``: the one place a wrapping
    driver (``kvfail.conformance.guard_driver``) changes the D engines another driver
    builds, however that driver reaches ``Engine``."""
    _SPEC_REWRITES.append(rewrite)
    try:
        yield
    finally:
        _SPEC_REWRITES.remove(rewrite)


#: ``forward(engine, worker, scheduler_output)``: runs inside the mixin's context, where a
#: real runner runs the model; e.g. a producer writes a byte pattern into its KV blocks.
#: In-process ranks only; :class:`~kvfail.harness.hooks.SplitForward` works for both.
ForwardHook = Callable[["Engine", Worker, "SchedulerOutput"], None]


# --------------------------------------------------------------------------- engine


class Engine:
    """One simulated vLLM engine (P or D): real Scheduler, real worker connectors, our loop.

    ``worker_build`` says how each rank's connector is built
    (:data:`~kvfail.harness.workers.WorkerBuild`).
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        forward: ForwardHook | SplitForward | None = None,
        worker_build: WorkerBuild = "direct",
        log_stats: bool = True,
        rank_env: Mapping[str, str] | None = None,
    ) -> None:
        for rewrite in _SPEC_REWRITES:
            spec = rewrite(spec)
        if worker_build == "transfer_group" and spec.tp_size != 1:
            raise ValueError("worker_build='transfer_group' supports tp_size=1 only")
        if spec.tp_mode == "processes" and not isinstance(forward, (SplitForward, type(None))):
            raise ValueError("rank processes need a SplitForward (a plain hook cannot cross)")
        self.spec = spec
        self.built: BuiltConfig = build_config(spec)
        self.vllm_config: VllmConfig = self.built.vllm_config
        self.kv_cache_config = self.built.kv_cache_config
        self.forward = forward
        self.record = EngineRecord()
        self.requests: dict[str, Request] = {}
        self._owns_transfer_group = False
        self._closed = False
        self._shm_ident: str | None = None
        self._crashed: Crash | None = None
        self._next_id = 0
        ensure_none_hash()
        set_harness_threads()
        ensure_world_of_one(self.vllm_config)
        # Before any connector is built: each reads vLLM's interface at construction.
        self._release_reporting = hold_reporting(spec.reporting)
        try:
            with set_current_vllm_config(self.vllm_config):
                self.scheduler: Scheduler = scheduler_class(spec.reporting)(
                    vllm_config=self.vllm_config,
                    kv_cache_config=self.kv_cache_config,
                    structured_output_manager=StructuredOutputManager(self.vllm_config),
                    block_size=spec.block_size,
                    log_stats=log_stats,
                )
                if spec.tp_mode == "processes":
                    # After the Scheduler: a scheduler-side server the ranks register
                    # with is already up.
                    self.workers, self._shm_ident = start_rank_processes(self.built, rank_env)
                else:
                    self.workers = [
                        build_worker(self.built, r, worker_build) for r in range(spec.tp_size)
                    ]
                    self._owns_transfer_group = worker_build == "transfer_group"
        except BaseException:
            self._release_reporting()
            raise
        self.aggregator: KVOutputAggregator | None = None
        if spec.tp_size > 1:
            assert self.scheduler.connector is not None
            self.aggregator = KVOutputAggregator.from_connector(
                self.scheduler.connector, spec.tp_size
            )
        self.vocab_size: int = self.vllm_config.model_config.get_vocab_size()
        self._hasher = get_request_block_hasher(spec.block_size, sha256)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None = None,
        *,
        prompt_len: int = 100,
        prompt: list[int] | None = None,
        prompt_seed: str | None = None,
        max_tokens: int = 4,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> Request:
        """Add a real ``Request`` (deterministic prompt unless ``prompt`` is given)."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if prompt is None:
            prompt = prompt_tokens(prompt_seed or request_id, prompt_len, self.vocab_size)
        request = new_request(
            request_id,
            prompt,
            max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params,
            eos_token_id=self.vllm_config.model_config.hf_config.eos_token_id,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_ids: str | Iterable[str]) -> list[str]:
        """Abort as the API server does (``finish_requests(..., FINISHED_ABORTED)``)."""
        with set_current_vllm_config(self.vllm_config):
            done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [r.request_id for r in done]

    def status(self, request_id: str) -> RequestStatus | None:
        request = self.requests.get(request_id)
        return None if request is None else request.status

    # ------------------------------------------------------------------ state

    @property
    def crashed(self) -> Crash | None:
        return self._crashed

    def is_idle(self) -> bool:
        """What the engine core's busy loop asks before stepping."""
        return not self.scheduler.has_requests()

    def waiting_for_remote(self) -> frozenset[str]:
        return frozenset(
            rid
            for rid, req in self.scheduler.requests.items()
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )

    # ------------------------------------------------------------------ the loop

    def step(self, *, force: bool = False) -> StepRecord:
        """One engine-core iteration; skipped (``ran=False``) when idle unless ``force``."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._crashed is not None:
            raise EngineCrashedError(
                f"engine crashed at step {self._crashed.step}: "
                f"{self._crashed.exc_type}: {self._crashed.message}"
            )
        step = self.record.steps
        if not force and self.is_idle():
            return StepRecord(step, ran=False)
        self.record.steps += 1
        with set_current_vllm_config(self.vllm_config):
            before = self.waiting_for_remote()
            ready = before & self.scheduler.finished_recving_kv_req_ids
            try:
                so = self.scheduler.schedule()
            except Exception as exc:
                self.record.waiting_for_remote.append(frozenset())
                self.record.load_starts.append(frozenset())
                return self._crash(step, "schedule", exc)
            waiting = self.waiting_for_remote()
            # A load starts when a request enters WAITING_FOR_REMOTE_KVS, including one
            # promoted and re-admitted for a new load within the same schedule() call.
            still_ready = self.scheduler.finished_recving_kv_req_ids
            starts = frozenset(
                r for r in waiting if r not in before or (r in ready and r not in still_ready)
            )
            self.record.waiting_for_remote.append(waiting)
            self.record.load_starts.append(starts)
            rank_outputs: list[ModelRunnerOutput] = []
            try:
                plan = self._plan_forward(so)
            except ForwardHookError as err:
                return self._crash(step, "forward[plan]", err.cause, waiting, so)
            remote = [w for w in self.workers if w.process is not None]
            for worker in remote:  # every rank process works concurrently, then gather
                assert worker.process is not None
                apply = plan[0].apply if plan is not None else None
                try:
                    worker.process.send_step(so, apply, None if plan is None else plan[1])
                except RankCrash as err:
                    self._drain(remote)
                    return self._crash(
                        step, f"{err.phase}[{worker.rank}]", err, waiting, so, tb=err.tb
                    )
            for worker in self.workers:
                try:
                    rank_outputs.append(self._run_worker(worker, so, plan))
                except ForwardHookError as err:
                    self._drain(remote)
                    return self._crash(step, f"forward[{worker.rank}]", err.cause, waiting, so)
                except RankCrash as err:
                    self._drain(remote)
                    return self._crash(
                        step, f"{err.phase}[{worker.rank}]", err, waiting, so, tb=err.tb
                    )
                except Exception as exc:
                    self._drain(remote)
                    return self._crash(step, f"worker[{worker.rank}]", exc, waiting, so)
                self._record_kv(step, worker.rank, rank_outputs[-1].kv_connector_output)
            mro = self._combine(rank_outputs)
            self._record_kv(step, None, mro.kv_connector_output, attribute=so)
            try:
                engine_outputs = self.scheduler.update_from_output(so, mro)
            except Exception as exc:
                return self._crash(step, "update_from_output", exc, waiting, so)
        outputs = tuple(
            OutputRecord(
                step=step,
                request_id=o.request_id,
                finish_reason=o.finish_reason,
                new_token_ids=tuple(o.new_token_ids),
                kv_transfer_params=o.kv_transfer_params,
            )
            for eco in engine_outputs.values()
            for o in eco.outputs
        )
        self.record.outputs.extend(outputs)
        return StepRecord(step, True, so.total_num_scheduled_tokens, waiting, outputs, None, starts)

    def run_until(
        self,
        predicate: Callable[[Engine], bool],
        *,
        max_steps: int = 200,
        timeout_s: float = 30.0,
        poll_s: float = 0.0,
        min_steps: int = 0,
        min_steps_cap_s: float | None = None,
    ) -> RunResult:
        """Step until ``predicate(self)``; bounded by ``max_steps`` AND ``timeout_s``.

        ``poll_s`` sleeps between steps, for real transports that progress in threads.
        ``min_steps``: the timeout does not end the run before this many steps, for at most
        ``min_steps_cap_s`` more seconds (default: ``timeout_s``, at least 10 s). Why: a
        connector acts only when D steps (its deadline is checked at a drain), so a test
        process starved of CPU that stepped 5 times in its window has not given the
        connector a fair chance (a loaded 2-core machine does that); the cap
        keeps steps that block from stretching the run without end.
        Never raises for a crash: returns ``reason="crash"`` (see ``record.crashes``).
        """
        start = time.monotonic()
        steps = 0
        cap = max(timeout_s, 10.0) if min_steps_cap_s is None else min_steps_cap_s
        while True:
            if self._crashed is not None:
                return RunResult(False, "crash", steps, time.monotonic() - start)
            if predicate(self):
                return RunResult(True, "predicate", steps, time.monotonic() - start)
            if steps >= max_steps:
                return RunResult(False, "max_steps", steps, time.monotonic() - start)
            elapsed = time.monotonic() - start
            if elapsed >= timeout_s and (steps >= min_steps or elapsed >= timeout_s + cap):
                return RunResult(False, "timeout", steps, time.monotonic() - start)
            self.step()
            steps += 1
            if poll_s > 0:
                time.sleep(poll_s)

    def run_until_idle(
        self, *, max_steps: int = 200, timeout_s: float = 30.0, poll_s: float = 0.0
    ) -> RunResult:
        return self.run_until(
            Engine.is_idle, max_steps=max_steps, timeout_s=timeout_s, poll_s=poll_s
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Shut the connectors down; idempotent. Leaves the process's world of one alone."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.close()
        if self._shm_ident is not None:
            release_shared_memory(self._shm_ident)
        if self._owns_transfer_group:
            release_transfer_group()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()
        self._release_reporting()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _plan_forward(self, so: SchedulerOutput) -> tuple[SplitForward, Any] | None:
        """A split forward's plan for this step (None: no split forward, or no tokens)."""
        if not isinstance(self.forward, SplitForward) or so.total_num_scheduled_tokens == 0:
            return None
        try:
            payload = self.forward.plan(self, so)
        except Exception as exc:
            raise ForwardHookError(exc) from exc
        return None if payload is None else (self.forward, payload)

    def _run_worker(
        self, worker: Worker, so: SchedulerOutput, plan: tuple[SplitForward, Any] | None
    ) -> ModelRunnerOutput:
        if worker.process is not None:
            result = worker.process.receive_step()
        else:
            forward: Callable[[], Any] | None = None
            if plan is not None:
                split, payload = plan
                view = worker.view(len(self.workers))
                forward = lambda: split.apply(view, payload)  # noqa: E731
            elif self.forward is not None and not isinstance(self.forward, SplitForward):
                hook = self.forward
                forward = lambda: hook(self, worker, so)  # noqa: E731
            layers = self.layer_context(worker, so) if self.spec.layer_forward_context else None
            with installed_as_transfer_group(worker.connector):
                result = run_worker_hooks(
                    worker.connector, so, self.vllm_config, forward, layers, self.spec.reporting
                )
        if result.no_forward is not None:
            return result.no_forward
        if plan is not None and plan[0].collect is not None:
            plan[0].collect(self, worker.rank, result.forward_result)
        return self._model_runner_output(so, result.kv_output)

    def layer_context(self, worker: Worker, so: SchedulerOutput) -> LayerContext:
        """The forward context's per-layer part, as the model runner builds it: each
        scheduled token's KV slot (its block in the layer's group, its offset), in the
        order of ``so.num_scheduled_tokens``. ``schedule()`` has already advanced each
        request's ``num_computed_tokens`` by what it scheduled."""
        bs = self.spec.block_size
        manager = self.scheduler.kv_cache_manager
        groups = self.spec.num_kv_cache_groups
        slots: list[list[int]] = [[] for _ in range(groups)]
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            first = request.num_computed_tokens - n
            blocks = manager.get_block_ids(req_id)
            for g in range(groups):
                slots[g] += [blocks[g][p // bs] * bs + p % bs for p in range(first, first + n)]
        per_group = [
            LayerAttentionMetadata(torch.tensor(s, dtype=torch.long), len(s)) for s in slots
        ]
        names = self.built.layer_names
        return LayerContext(
            attn_metadata={name: per_group[i % groups] for i, name in enumerate(names)},
            layers={name: KVLayer(worker.kv_caches[name]) for name in names},
        )

    @staticmethod
    def _drain(remote: list[Worker]) -> None:
        """After a crash mid-step, read (and drop) what the other ranks still owe."""
        for worker in remote:
            assert worker.process is not None
            worker.process.discard_reply()

    def _model_runner_output(
        self, so: SchedulerOutput, kv_output: KVConnectorOutput | None
    ) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            if request.is_prefill_chunk:
                sampled.append([])  # the runner discards a partial prefill's sample
                continue
            sampled.append([sampled_token(req_id, request.num_tokens, self.vocab_size)])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,  # as the runner does, empty or not
        )

    def _combine(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        if self.aggregator is None:
            return outputs[0]
        # Workers in a real executor send serialized copies; keep ours independent too.
        combined = self.aggregator.aggregate([copy.copy(o) for o in outputs], output_rank=0)
        assert combined is not None
        return combined

    def _record_kv(
        self,
        step: int,
        rank: int | None,
        output: KVConnectorOutput | None,
        attribute: SchedulerOutput | None = None,
    ) -> None:
        if output is None:
            return
        report = KVReport(
            step=step,
            rank=rank,
            finished_recving=frozenset(output.finished_recving or ()),
            failed_recving=compat.output_failed_recving(output),
            invalid_block_ids=frozenset(output.invalid_block_ids or ()),
            finished_sending=frozenset(output.finished_sending or ()),
        )
        if report.empty:
            return
        if attribute is not None:
            report = dataclasses.replace(report, failed_requests=self._attribute(report))
        self.record.kv_reports.append(report)

    def _attribute(self, report: KVReport) -> frozenset[str]:
        """Which tracked requests a failure report touches, before the scheduler acts."""
        failed = set(report.failed_recving) & set(self.scheduler.requests)
        if report.invalid_block_ids:
            manager = self.scheduler.kv_cache_manager
            for req_id, request in self.scheduler.requests.items():
                if request.status not in (
                    RequestStatus.WAITING_FOR_REMOTE_KVS,
                    RequestStatus.RUNNING,
                ):
                    continue
                blocks = {b for group in manager.get_block_ids(req_id) for b in group}
                if blocks & report.invalid_block_ids:
                    failed.add(req_id)
        return frozenset(failed)

    def _crash(
        self,
        step: int,
        phase: str,
        exc: BaseException,
        waiting: frozenset[str] = frozenset(),
        so: SchedulerOutput | None = None,
        *,
        tb: str | None = None,
    ) -> StepRecord:
        rank_crash = isinstance(exc, RankCrash)
        crash = Crash(
            step=step,
            phase=phase,
            exc_type=exc.exc_type if isinstance(exc, RankCrash) else type(exc).__name__,
            message=exc.message if isinstance(exc, RankCrash) else str(exc),
            traceback=tb if rank_crash and tb else "".join(traceback.format_exception(exc)),
        )
        self.record.crashes.append(crash)
        self._crashed = crash
        tokens = 0 if so is None else so.total_num_scheduled_tokens
        return StepRecord(step, True, tokens, waiting, (), crash)
