"""Real tensor parallelism for a harness engine: one OS process per TP rank.

Why: a connector picks its peer rank, its head slice and its side-channel port from its
TP rank (``get_tensor_model_parallel_rank()``), which is vLLM's process-global distributed
state. Two worker connectors in one process are both rank 0 of a world of one, so a real
transport cannot be tested at TP 2 that way. Here each rank is what it is in a real
``MultiprocExecutor``: its own process, a real gloo world of ``tp_size`` on 127.0.0.1
(``init_distributed_environment`` + ``ensure_model_parallel_initialized(tp, 1)``), its own
transfer group built by vLLM's ``ensure_kv_transfer_initialized``, its own KV tensors. The
scheduler process sends each rank the pickled ``SchedulerOutput`` (as the executor's
message queue does) and gets back the rank's ``KVConnectorOutput``, which the engine
aggregates with vLLM's ``KVOutputAggregator``. A fault on one rank is then a real one:
kill that process, or arm a fault in it only (:meth:`RankProcess.call`).

Processes come from a ``forkserver`` whose preload imports this module (and so vLLM)
once; each rank is then a fork of a clean, single-threaded process that has never
touched gloo, a transport or the test's state: about a second instead of a fresh vLLM
import per rank. A rank exits when its pipe closes, so it never outlives its engine's
process, and it shares its parent's process group (killing P's group kills P's ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvfail.harness.config import EngineSpec, build_config
from kvfail.harness.hooks import ForwardHookError, RankView, StepResult, run_worker_hooks
from kvfail.harness.reporting import hold as hold_reporting
from kvfail.harness.threads import set_harness_threads
from kvfail.rig import nixl_progress
from kvfail.rig.cpu_shim import cpu_accelerator_index_shim
from kvfail.rig.stacks import install_stack_dump

__all__ = ["RankCrash", "RankProcess", "fork_forkserver"]

#: Bound on one rank's answer to one command (a worker step takes milliseconds; a
#: connector hook that blocks this long is reported as a crash of that rank).
STEP_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 240.0

_CTX_LOCK = threading.Lock()
_CTX: Any = None


def _context() -> Any:
    """The forkserver context, preloading this module (vLLM) into the server once."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            _CTX = ctx
        return _CTX


def fork_forkserver() -> None:
    """Start this process's rank forkserver by forking this process, not by a new
    interpreter: a zygote's child (:mod:`kvfail.rig.zygote`) already holds vLLM and has
    one thread, so the server it forks is as clean as a preloaded one, without a second
    vLLM import. Call it before any thread starts; a no-op once a server runs.

    This fills in the fields of multiprocessing's forkserver that its own start fills in
    (address, alive pipe, pid); the server's loop is multiprocessing's own ``main``.
    """
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    _context()
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()
        address = connection.arbitrary_address("AF_UNIX")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: serves until every holder of alive_w is gone
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


class RankCrash(Exception):
    """A rank's hook (``phase="worker"``) or forward (``"forward"``) raised, or the rank
    died or stopped answering (``"worker"``); carries the rank's own traceback."""

    def __init__(self, rank: int, phase: str, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} {phase}: {exc_type}: {message}")
        self.rank = rank
        self.phase = phase
        self.exc_type = exc_type
        self.message = message
        self.tb = tb


# --------------------------------------------------------------------------- rank side


def _spec_to_dict(spec: EngineSpec) -> dict[str, Any]:
    """EngineSpec's read-only extra_config does not pickle; ship plain values."""
    out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    out["extra_config"] = dict(spec.extra_config)
    return out


def _rank_main(
    conn: multiprocessing.connection.Connection,
    spec_dict: dict[str, Any],
    rank: int,
    init_method: str,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    install_stack_dump()  # a rank that stops answering can still be asked where it is
    try:
        view = _build_rank(EngineSpec(**spec_dict), rank, init_method)
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", os.getpid()))
    vllm_config = view.built.vllm_config
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the engine is gone: so is this rank
        kind = message[0]
        if kind == "close":
            break
        try:
            with set_current_vllm_config(vllm_config):
                if kind == "step":
                    _, so, apply, payload = message
                    forward = None if apply is None else functools.partial(apply, view, payload)
                    mode = view.built.spec.reporting
                    result = run_worker_hooks(view.connector, so, vllm_config, forward, None, mode)
                    reply: Any = ("ok", result)
                else:  # "call"
                    _, fn, args = message
                    reply = ("ok", fn(view, *args))
        except ForwardHookError as err:
            reply = ("crash", "forward", *_describe(err.cause))
        except BaseException as exc:
            reply = ("crash", "worker", *_describe(exc))
        conn.send(reply)
    with contextlib.suppress(BaseException):
        view.connector.shutdown()
    # Native transports may crash in their own atexit handlers; nothing is left to flush.
    os._exit(0)


def _describe(exc: BaseException) -> tuple[str, str, str]:
    return type(exc).__name__, str(exc), "".join(traceback.format_exception(exc))


def _build_rank(spec: EngineSpec, rank: int, init_method: str) -> RankView:
    """What a real worker process does before serving: distributed init, the transfer
    group, KV tensors, ``register_kv_caches``."""
    nixl_progress.apply_from_env()
    set_harness_threads()
    hold_reporting(spec.reporting)  # for the process's life, before the connector is built
    built = build_config(spec)
    vllm_config = built.vllm_config
    # vLLM's CpuWorker names the ranks' shared-memory group after the init port; the
    # engine gives its ranks a unique name instead (kvfail.rig.shm).
    os.environ.setdefault("VLLM_DIST_IDENT", init_method.rsplit(":", 1)[-1])
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=spec.tp_size,
            rank=rank,
            distributed_init_method=init_method,
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(spec.tp_size, 1)
        with cpu_accelerator_index_shim():
            kv_transfer_state.ensure_kv_transfer_initialized(vllm_config, built.kv_cache_config)
        connector = kv_transfer_state.get_kv_transfer_group()
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        kv_caches = allocate_kv_cache(
            built.kv_cache_config,
            torch.device("cpu"),
            layout,
            kernel_block_sizes=[spec.block_size] * len(built.kv_cache_config.kv_cache_groups),
        )
        connector.register_kv_caches(kv_caches)
    return RankView(rank, spec.tp_size, connector, kv_caches, built)


# --------------------------------------------------------------------------- engine side


class RankProcess:
    """The scheduler process's handle on one rank process."""

    def __init__(
        self,
        spec: EngineSpec,
        rank: int,
        init_method: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        ctx = _context()
        self.rank = rank
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_rank_main,
            # The engine process's environment now (the forkserver's is from its start),
            # as a real executor's workers inherit it.
            args=(child, _spec_to_dict(spec), rank, init_method, {**os.environ, **(env or {})}),
            name=f"kvfail-rank{rank}-{spec.engine_id or 'engine'}",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._pending = False
        self._closed = False
        self.pid: int | None = self._process.pid

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Block (bounded) until the rank has built its connector; returns its pid."""
        reply = self._receive(timeout_s, "start")
        if reply[0] != "ready":
            _, exc_type, message, tb = reply
            raise RankCrash(self.rank, "start", exc_type, message, tb)
        self.pid = int(reply[1])
        return self.pid

    # The two halves of a step are separate so an engine can send to every rank first
    # and then gather: ranks run concurrently, as a real executor's do.
    def send_step(
        self, so: Any, apply: Callable[[RankView, Any], Any] | None, payload: Any
    ) -> None:
        self._send(("step", so, apply, payload))

    def receive_step(self, timeout_s: float = STEP_TIMEOUT_S) -> StepResult:
        result: StepResult = self._result(timeout_s, "step")
        return result

    def discard_reply(self, timeout_s: float = 10.0) -> None:
        """Read and drop the reply to a step sent before another rank crashed, so the
        pipe stays in step; nothing to do when no reply is outstanding."""
        if self._pending:
            with contextlib.suppress(Exception):
                self._receive(timeout_s, "step")

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        """Run ``fn(view, *args)`` on the rank (``fn`` module-level); returns its result."""
        self._send(("call", fn, args))
        return self._result(timeout_s, "call")

    def alive(self) -> bool:
        return self._process.is_alive()

    def kill(self) -> None:
        """SIGKILL this rank only (a one-rank crash)."""
        if self.pid is not None and self._process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self._process.join(5.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the rank to shut its connector down and exit; kill it if it does not."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._conn.send(("close",))
        self._process.join(timeout_s)
        if self._process.is_alive():
            self.kill()
        with contextlib.suppress(Exception):
            self._conn.close()

    # ------------------------------------------------------------------ internals

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._pending:
            raise RuntimeError(f"rank {self.rank}: a reply is still outstanding")
        try:
            self._conn.send(message)
        except (OSError, EOFError) as exc:
            raise self._dead("send", exc) from exc
        self._pending = True

    def _receive(self, timeout_s: float, what: str) -> tuple[Any, ...]:
        try:
            if not self._conn.poll(timeout_s):
                raise RankCrash(
                    self.rank, "worker", "TimeoutError", f"no answer to {what} in {timeout_s}s", ""
                )
            reply: tuple[Any, ...] = self._conn.recv()
        except (OSError, EOFError) as exc:
            raise self._dead(what, exc) from exc
        finally:
            self._pending = False
        return reply

    def _result(self, timeout_s: float, what: str) -> Any:
        reply = self._receive(timeout_s, what)
        if reply[0] == "ok":
            return reply[1]
        _, phase, exc_type, message, tb = reply
        raise RankCrash(self.rank, phase, exc_type, message, tb)

    def _dead(self, what: str, exc: BaseException) -> RankCrash:
        self._process.join(1.0)
        code = self._process.exitcode
        return RankCrash(
            self.rank,
            "worker",
            "RankDied",
            f"rank process gone during {what} (exit {code})",
            f"{type(exc).__name__}: {exc}",
        )
