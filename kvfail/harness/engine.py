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

Everything the scheduler saw is recorded (:class:`EngineRecord`): each ``EngineCoreOutput``,
each rank's raw ``KVConnectorOutput`` and the aggregated one, which request ids were in
``WAITING_FOR_REMOTE_KVS`` after each ``schedule()``, and which requests each failure
report touched. An exception from a worker hook or from ``update_from_output`` (C7's
``assert req_id in self.requests``, C5's ``RuntimeError``) would kill a real EngineCore;
here it is recorded as a :class:`Crash` and the engine refuses further steps.

World of one. Worker connectors that ask for TP/PP ranks need vLLM's distributed state,
so the first engine in a process runs the real ``init_distributed_environment`` (gloo,
world size 1, on 127.0.0.1) and ``ensure_model_parallel_initialized(1, 1)``.

TP = 2, two ways (``EngineSpec.tp_mode``). ``"processes"`` is real TP: each rank is its own
OS process in a real gloo world of ``tp_size`` (:mod:`kvfail.harness.ranks`), with its own
transfer group, KV tensors and TP rank, and vLLM's TP size set, so a real transport picks
its peer rank and head slice as in production; the scheduler process sends each rank the
``SchedulerOutput`` and aggregates their outputs. ``"simulated"`` (the default, cheap)
builds every rank's WORKER-role instance in this process and runs each in turn with that
instance installed as the transfer group; each still sees TP rank 0 of a world of one, so
it is honest only for connectors whose reporting does not depend on the rank (the toy,
the reporter's bookkeeping). Both run the worker hooks through one function
(:func:`kvfail.harness.hooks.run_worker_hooks`); a forward that must reach the rank's
tensors is a :class:`~kvfail.harness.hooks.SplitForward`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvfail import compat
from kvfail.harness.config import BuiltConfig, EngineSpec, build_config
from kvfail.harness.hooks import (
    ForwardHookError,
    KVLayer,
    LayerAttentionMetadata,
    LayerContext,
    RankView,
    SplitForward,
    run_worker_hooks,
)
from kvfail.harness.ranks import RankCrash, RankProcess
from kvfail.harness.reporting import hold as hold_reporting
from kvfail.harness.reporting import scheduler_class
from kvfail.rig import nixl_progress
from kvfail.rig.shm import new_shm_ident, release_shared_memory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "Crash",
    "Engine",
    "EngineCrashedError",
    "EngineRecord",
    "ForwardHook",
    "KVReport",
    "OutputRecord",
    "RunResult",
    "StepRecord",
    "Worker",
    "ensure_world_of_one",
    "prompt_tokens",
    "rewriting_specs",
]

WorkerBuild = Literal["direct", "transfer_group"]

#: Token ids below this are never generated (0-2 are pad/bos/eos in the shipped models),
#: so a request ends by ``max_tokens`` and never by an accidental EOS.
FIRST_FREE_TOKEN = 3


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


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class OutputRecord:
    """One ``EngineCoreOutput`` the scheduler returned from ``update_from_output``."""

    step: int
    request_id: str
    finish_reason: FinishReason | None
    new_token_ids: tuple[int, ...]
    kv_transfer_params: Mapping[str, Any] | None


@dataclass(frozen=True)
class KVReport:
    """One ``KVConnectorOutput``: a rank's raw output (``rank`` >= 0) or the scheduler's.

    ``rank`` is ``None`` for what ``update_from_output`` actually received (after TP
    aggregation). ``failed_requests`` is the harness's attribution, computed before the
    scheduler acted on it: ids in ``failed_recving`` plus every waiting or running request
    owning a block in ``invalid_block_ids``.
    """

    step: int
    rank: int | None
    finished_recving: frozenset[str]
    failed_recving: frozenset[str]
    invalid_block_ids: frozenset[int]
    finished_sending: frozenset[str]
    failed_requests: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (
            self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.finished_sending
        )


@dataclass(frozen=True)
class Crash:
    """An exception that would have killed a real EngineCore or worker."""

    step: int
    phase: str  # "update_from_output", "worker[<rank>]", "schedule", "forward[<rank>]"
    exc_type: str
    message: str
    traceback: str

    @property
    def clause(self) -> str:
        """The contract clause this crash most likely violates (for oracle messages)."""
        if self.exc_type == "RuntimeError" and "KV cache groups" in self.message:
            return "C5"
        if self.phase == "update_from_output" and self.exc_type == "AssertionError":
            return "C7"
        if self.phase.startswith("worker"):
            return "C13"
        return "crash"


@dataclass(frozen=True)
class StepRecord:
    """What one :meth:`Engine.step` did."""

    step: int
    ran: bool
    num_scheduled_tokens: int = 0
    waiting_for_remote: frozenset[str] = frozenset()
    outputs: tuple[OutputRecord, ...] = ()
    crash: Crash | None = None
    load_starts: frozenset[str] = frozenset()


@dataclass
class EngineRecord:
    """Everything observed over an engine's life, for the oracles."""

    steps: int = 0
    outputs: list[OutputRecord] = field(default_factory=list)
    #: Raw per-rank reports and the scheduler's view, in step order (empty ones skipped).
    kv_reports: list[KVReport] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    #: Index = step number (steps that ran): ids in WAITING_FOR_REMOTE_KVS right after
    #: ``schedule()``.
    waiting_for_remote: list[frozenset[str]] = field(default_factory=list)
    #: Index = step number: ids whose async load started in that step's ``schedule()``.
    load_starts: list[frozenset[str]] = field(default_factory=list)

    def scheduler_reports(self) -> list[KVReport]:
        return [r for r in self.kv_reports if r.rank is None]

    def rank_reports(self, rank: int) -> list[KVReport]:
        return [r for r in self.kv_reports if r.rank == rank]

    def outputs_for(self, request_id: str) -> list[OutputRecord]:
        return [o for o in self.outputs if o.request_id == request_id]

    def load_episodes(self, request_id: str) -> int:
        """How many async loads the request started (entries into WAITING_FOR_REMOTE_KVS)."""
        return sum(request_id in starts for starts in self.load_starts)

    def load_start_steps(self, request_id: str) -> list[int]:
        return [step for step, starts in enumerate(self.load_starts) if request_id in starts]


@dataclass(frozen=True)
class RunResult:
    """How :meth:`Engine.run_until` ended."""

    ok: bool
    reason: Literal["predicate", "max_steps", "timeout", "crash"]
    steps: int
    elapsed_s: float


class EngineCrashedError(RuntimeError):
    """Raised by :meth:`Engine.step` after a crash: a real EngineCore would be dead."""


# --------------------------------------------------------------------------- workers


class Worker:
    """One TP rank: its WORKER-role connector and its own KV tensors, either here
    (``tp_mode="simulated"``) or in the rank's own process (``"processes"``).

    :meth:`call` works for both; ``connector`` and ``kv_caches`` only for a rank in this
    process (a rank process's objects cannot be touched from here).
    """

    def __init__(
        self,
        rank: int,
        connector: KVConnectorBase_V1 | None = None,
        kv_caches: dict[str, torch.Tensor] | None = None,
        *,
        process: RankProcess | None = None,
        built: BuiltConfig | None = None,
    ) -> None:
        self.rank = rank
        self._connector = connector
        self._kv_caches = kv_caches
        self.process = process
        self._built = built

    @property
    def remote(self) -> bool:
        return self.process is not None

    @property
    def connector(self) -> KVConnectorBase_V1:
        if self._connector is None:
            raise AttributeError(f"rank {self.rank} runs in its own process; use Worker.call")
        return self._connector

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        if self._kv_caches is None:
            raise AttributeError(f"rank {self.rank} runs in its own process; use Worker.call")
        return self._kv_caches

    def view(self, world_size: int) -> RankView:
        assert self._built is not None
        return RankView(self.rank, world_size, self.connector, self.kv_caches, self._built)

    def call(self, fn: Callable[..., Any], *args: Any, world_size: int = 1) -> Any:
        """``fn(view, *args)`` where the rank lives (``fn`` module-level for a process)."""
        if self.process is not None:
            return self.process.call(fn, *args)
        return fn(self.view(world_size), *args)


#: ``forward(engine, worker, scheduler_output)``: runs inside the mixin's context, where a
#: real runner runs the model; e.g. a producer writes a byte pattern into its KV blocks.
#: In-process ranks only; :class:`~kvfail.harness.hooks.SplitForward` works for both.
ForwardHook = Callable[["Engine", Worker, "SchedulerOutput"], None]


def _free_local_port() -> int:
    """A rendezvous port for a TP world, picked below the kernel's ephemeral range: a port
    from ``bind(port 0)`` can be taken by any outgoing connect before the rank binds it
    (seen as a rank failing its TCPStore listen with EADDRINUSE)."""
    from kvfail.faults.process import free_port

    return free_port()


def ensure_world_of_one(vllm_config: VllmConfig) -> None:
    """Real gloo init, world size 1 on 127.0.0.1, once per process (idempotent)."""
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if torch.distributed.is_initialized() and model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_local_port()}",
                local_rank=0,
                backend="gloo",
            )
        ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def _installed_as_transfer_group(connector: KVConnectorBase_V1) -> Iterator[None]:
    """Make ``connector`` the process's KV transfer group while one rank's hooks run.

    vLLM's mixin reads the group through ``get_kv_transfer_group()``, a module global; a
    real worker process has exactly one. Swapping it per rank lets the real mixin drive
    several simulated ranks in one process.
    """
    previous = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = previous


_NONE_HASH_READY = False


def _ensure_none_hash() -> None:
    """``init_none_hash`` once per process, as the engine core does at start-up."""
    global _NONE_HASH_READY
    if not _NONE_HASH_READY:
        init_none_hash(sha256)
        _NONE_HASH_READY = True


def prompt_tokens(seed: str, length: int, vocab_size: int) -> list[int]:
    """Deterministic prompt: same seed, same tokens (so P and D can share a prompt), and
    different seeds share no prefix block in practice (so prefix caching stays out of the
    way unless a test wants it)."""
    span = vocab_size - FIRST_FREE_TOKEN
    return [FIRST_FREE_TOKEN + zlib.crc32(f"{seed}:{i}".encode()) % span for i in range(length)]


# --------------------------------------------------------------------------- engine


class Engine:
    """One simulated vLLM engine (P or D): real Scheduler, real worker connectors, our loop.

    ``worker_build="direct"`` builds each rank's connector with
    ``KVConnectorFactory.create_connector(vllm_config, WORKER, kv_cache_config)``, i.e.
    ``Cls(vllm_config, KVConnectorRole.WORKER, kv_cache_config)``;
    ``"transfer_group"`` uses ``ensure_kv_transfer_initialized`` exactly as a GPU/CPU
    worker does (process-global, so TP must be 1 and only one such engine may exist).
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
        self._worker_build = worker_build
        self._owns_transfer_group = False
        self._closed = False
        self._shm_ident: str | None = None
        self._crashed: Crash | None = None
        self._next_id = 0
        _ensure_none_hash()
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
                    self.workers: list[Worker] = self._start_rank_processes(rank_env)
                else:
                    self.workers = [self._build_worker(r) for r in range(spec.tp_size)]
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

    def _build_worker(self, rank: int) -> Worker:
        nixl_progress.apply_from_env()
        if self._worker_build == "transfer_group":
            if kv_transfer_state.has_kv_transfer_group():
                raise RuntimeError("a KV transfer group already exists in this process")
            kv_transfer_state.ensure_kv_transfer_initialized(self.vllm_config, self.kv_cache_config)
            self._owns_transfer_group = True
            connector = kv_transfer_state.get_kv_transfer_group()
        else:
            # Cls(vllm_config, WORKER, kv_cache_config), plus the factory's own checks.
            connector = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
        assert isinstance(connector, KVConnectorBase_V1)
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        kv_caches = allocate_kv_cache(
            self.kv_cache_config,
            torch.device("cpu"),
            layout,
            kernel_block_sizes=[self.spec.block_size] * len(self.kv_cache_config.kv_cache_groups),
        )
        connector.register_kv_caches(kv_caches)
        return Worker(rank, connector, kv_caches, built=self.built)

    def _start_rank_processes(self, env: Mapping[str, str] | None) -> list[Worker]:
        """One process per rank, in a gloo world of ``tp_size`` (after the Scheduler, so
        a scheduler-side server the ranks register with is already up)."""
        init_method = f"tcp://127.0.0.1:{_free_local_port()}"
        self._shm_ident = new_shm_ident()
        env = {**(env or {}), "VLLM_DIST_IDENT": self._shm_ident}
        procs = [RankProcess(self.spec, r, init_method, env) for r in range(self.spec.tp_size)]
        try:
            for proc in procs:
                proc.wait_ready()
        except BaseException:
            for proc in procs:
                proc.close(timeout_s=2.0)
            release_shared_memory(self._shm_ident)
            raise
        return [Worker(p.rank, process=p, built=self.built) for p in procs]

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
        extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
        params.update_from_generation_config(
            {}, self.vllm_config.model_config.hf_config.eos_token_id
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
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
                if worker.process is not None:
                    worker.process.close()
                else:
                    worker.connector.shutdown()
        if self._shm_ident is not None:
            release_shared_memory(self._shm_ident)
        if self._owns_transfer_group:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
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
            with _installed_as_transfer_group(worker.connector):
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
        span = self.vocab_size - FIRST_FREE_TOKEN
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            if request.is_prefill_chunk:
                sampled.append([])  # the runner discards a partial prefill's sample
                continue
            token = FIRST_FREE_TOKEN + zlib.crc32(f"{req_id}:{request.num_tokens}".encode()) % span
            sampled.append([token])
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
