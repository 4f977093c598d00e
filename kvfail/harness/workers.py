"""An engine's TP ranks: each rank's WORKER-role connector and its own KV tensors.

Why a module of its own: building a rank is vLLM's worker start-up (the world of one, the
transfer group, ``allocate_kv_cache``, ``register_kv_caches``), which :class:`Engine
<kvfail.harness.engine.Engine>` needs once, while its stepping loop only calls a rank.

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
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvfail.harness.config import BuiltConfig
from kvfail.harness.hooks import RankView
from kvfail.harness.ranks import RankCrash, RankProcess
from kvfail.rig import nixl_progress
from kvfail.rig.ports import lost_its_port
from kvfail.rig.shm import new_shm_ident, release_shared_memory

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_log = logging.getLogger(__name__)

__all__ = [
    "Worker",
    "WorkerBuild",
    "build_worker",
    "ensure_world_of_one",
    "installed_as_transfer_group",
    "release_transfer_group",
    "start_rank_processes",
]

#: ``"direct"`` builds each rank's connector with
#: ``KVConnectorFactory.create_connector(vllm_config, WORKER, kv_cache_config)``, i.e.
#: ``Cls(vllm_config, KVConnectorRole.WORKER, kv_cache_config)``; ``"transfer_group"`` uses
#: ``ensure_kv_transfer_initialized`` exactly as a GPU/CPU worker does (process-global, so
#: TP must be 1 and only one such engine may exist).
WorkerBuild = Literal["direct", "transfer_group"]


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

    def close(self) -> None:
        """Stop the rank: its process, or its connector's ``shutdown()``."""
        if self.process is not None:
            self.process.close()
        else:
            self.connector.shutdown()


def _free_local_port() -> int:
    """A rendezvous port for a TP world, picked below the kernel's ephemeral range: a port
    from ``bind(port 0)`` can be taken by any outgoing connect before the rank binds it
    (seen as a rank failing its TCPStore listen with EADDRINUSE)."""
    from kvfail.rig.ports import free_port

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
def installed_as_transfer_group(connector: KVConnectorBase_V1) -> Iterator[None]:
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


def release_transfer_group() -> None:
    """Forget the process's transfer group that a ``"transfer_group"`` build made."""
    kv_transfer_state._KV_CONNECTOR_AGENT = None


def build_worker(built: BuiltConfig, rank: int, how: WorkerBuild) -> Worker:
    """Build rank ``rank`` in this process, as a worker process starts: its connector
    (see :data:`WorkerBuild`), then its CPU KV tensors, registered with it."""
    nixl_progress.apply_from_env()
    vllm_config, kv_cache_config = built.vllm_config, built.kv_cache_config
    if how == "transfer_group":
        if kv_transfer_state.has_kv_transfer_group():
            raise RuntimeError("a KV transfer group already exists in this process")
        kv_transfer_state.ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
        connector = kv_transfer_state.get_kv_transfer_group()
    else:
        # Cls(vllm_config, WORKER, kv_cache_config), plus the factory's own checks.
        connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
    assert isinstance(connector, KVConnectorBase_V1)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    kv_caches = allocate_kv_cache(
        kv_cache_config,
        torch.device("cpu"),
        layout,
        kernel_block_sizes=[built.spec.block_size] * len(kv_cache_config.kv_cache_groups),
    )
    connector.register_kv_caches(kv_caches)
    return Worker(rank, connector, kv_caches, built=built)


#: How often a TP world whose rendezvous port was taken is started again on a fresh one.
RENDEZVOUS_RETRIES = 2


def start_rank_processes(
    built: BuiltConfig, env: Mapping[str, str] | None
) -> tuple[list[Worker], str]:
    """One process per rank, in a gloo world of ``tp_size``, and the shared-memory name
    they share (the caller releases it when the ranks are gone). Start them after the
    Scheduler, so a scheduler-side server the ranks register with is already up.

    Rank 0 binds the world's rendezvous port after we picked it, so another bind can win
    the race (no pick can close it); a world that lost its port is started again on a
    fresh one, at most :data:`RENDEZVOUS_RETRIES` times."""
    retries = RENDEZVOUS_RETRIES
    while True:
        try:
            return _start_world(built, env)
        except RankCrash as exc:
            if retries <= 0 or exc.phase != "start" or not lost_its_port(exc.message):
                raise
            retries -= 1
            _log.warning("a TP world lost its rendezvous port to another bind; restarting it")


def _start_world(built: BuiltConfig, env: Mapping[str, str] | None) -> tuple[list[Worker], str]:
    spec = built.spec
    init_method = f"tcp://127.0.0.1:{_free_local_port()}"
    shm_ident = new_shm_ident()
    env = {**(env or {}), "VLLM_DIST_IDENT": shm_ident}
    procs = [RankProcess(spec, r, init_method, env) for r in range(spec.tp_size)]
    try:
        for proc in procs:
            proc.wait_ready()
    except BaseException:
        for proc in procs:
            proc.close(timeout_s=2.0)
        release_shared_memory(shm_ident)
        raise
    return [Worker(p.rank, process=p, built=built) for p in procs], shm_ident
