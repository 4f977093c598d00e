"""A real NIXL P/D pair: P in its own OS process, D engines in this one, UCX TCP on 127.0.0.1.

Why: the conformance suite must see what a *real* NIXL transfer reports when the peer
dies, freezes or is misaddressed, through vLLM's real scheduler. :class:`NixlPair` starts
P (:mod:`kvfail.peers.nixl_producer`: real ``Scheduler`` + real WORKER-role NIXL pull
connector, KV caches as CPU tensors, ``kv_buffer_device="cpu"``, DRAM) as a
:class:`~kvfail.faults.PeerProcess`, and builds D as harness
:class:`~kvfail.harness.Engine` objects *here*, so the suite's oracles read D's real
scheduler directly. D pulls (READ) P's blocks after the zmq side-channel handshake that
``kv_transfer_params`` (``remote_host``/``remote_port``) point at.

Faults that are honest with NIXL on TCP loopback (``workers-on-cpu.md``, measured there):

* ``kill`` P *after the handshake, before the READ* (:meth:`NixlPair.fault_after_handshake`
  or a warm D): the READ post raises ``nixlRemoteDisconnectError`` at once;
* ``freeze`` P (SIGSTOP) after the handshake: the READ sits in ``PROC``; upstream D has no
  deadline for it and waits forever, kvfail's connector fails it at ``kvfail_deadline_s``;
* a wrong side-channel port (:func:`wrong_port`): zmq silently retries a refused connect,
  the handshake fails at its 5 s ``RCVTIMEO``;
* a wrong engine id (:func:`unknown_engine`): P answers the handshake for another engine;
* :meth:`NixlPair.restart_p` replaces P (new process, new port).

The nixl teardown segfault. Any process that created a nixl UCX agent segfaults in
``_dl_fini`` at a normal interpreter exit (rc 139), so a process holding D engines must
end with ``os._exit``. :func:`install_exit_guard` (called when the first D is built)
registers an ``atexit`` handler that flushes stdio and calls ``os._exit`` with the
process's real exit status: pytest's session status (recorded by a small hook registered
on the running pytest config), else 1 after an uncaught exception, else the ``sys.exit``
code. Other ``atexit`` handlers registered *before* it still run (LIFO); later ones are
skipped, which is why it is installed as late as possible.

D's verification: D's forward hook runs when a request is first scheduled after its load
(where a real model would read the pulled KV) and compares every pulled token of every
layer with :mod:`kvfail.peers.pattern`; :meth:`NixlPair.verify` returns that result.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.faults import free_port
from kvfail.peers.base import PeerPair, ProducerHandleBase, closed_port, with_param
from kvfail.peers.nixl_producer import PREFIX, restore_affinity

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvfail.harness import Engine, RunResult, Worker

__all__ = [
    "NIXL_ENV",
    "DecodeRecord",
    "NixlPair",
    "NixlProducerHandle",
    "install_exit_guard",
    "nixl_available",
    "unknown_engine",
    "wrong_port",
]

#: Environment every NIXL engine process needs; each also gets its own side-channel port.
NIXL_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}
#: How long upstream's handshake waits for P's answer (zmq ``RCVTIMEO``, hard-coded).
HANDSHAKE_TIMEOUT_S = 5.0


def nixl_available() -> str | None:
    """None when a real NIXL worker can be built here, else the reason it cannot."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # ImportError, or a missing native library
        return f"nixl not importable: {type(exc).__name__}: {exc}"
    return None


def wrong_port(params: Mapping[str, Any], port: int | None = None) -> dict[str, Any]:
    """``params`` with a side-channel port nobody listens on (handshake times out, 5 s)."""
    return with_param(params, "remote_port", port or closed_port())


def unknown_engine(params: Mapping[str, Any], engine_id: str = "no-such-engine") -> dict[str, Any]:
    """``params`` naming an engine id other than the one P's side channel answers for."""
    return with_param(params, "remote_engine_id", engine_id)


# --------------------------------------------------------------------------- exit guard


class _ExitGuard:
    """Ends this process with ``os._exit(status)`` instead of a segfaulting normal exit."""

    def __init__(self) -> None:
        self.installed = False
        self.pytest_status: int | None = None
        self.sys_exit_code: int | None = None
        self.uncaught = False
        self._lock = threading.Lock()

    # pytest hook (registered on the running config's plugin manager)
    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        self.pytest_status = int(exitstatus)

    def install(self, config: Any = None) -> None:
        with self._lock:
            if self.installed:
                return
            self.installed = True
        if config is None:
            config = _running_pytest_config()
        if config is not None:
            with contextlib.suppress(Exception):
                config.pluginmanager.register(self, "kvfail-nixl-exit-guard")
        previous_hook = sys.excepthook

        def excepthook(*args: Any) -> None:
            self.uncaught = True
            previous_hook(*args)

        sys.excepthook = excepthook
        real_exit = sys.exit

        def recording_exit(code: Any = None) -> None:
            self.sys_exit_code = _code_of(code)
            real_exit(code)

        sys.exit = recording_exit  # type: ignore[assignment]
        atexit.register(self._exit)

    def status(self) -> int:
        if self.pytest_status is not None:
            return self.pytest_status
        if self.uncaught:
            return 1
        return self.sys_exit_code or 0

    def _exit(self) -> None:
        code = self.status()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _code_of(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints it and exits 1


def _running_pytest_config() -> Any:
    """The live ``pytest.Config`` when pytest runs this process, else None (found once)."""
    if "_pytest.config" not in sys.modules:
        return None
    from _pytest.config import Config

    # ``type(o) is``, not isinstance: isinstance reads ``__class__``, which some lazy
    # objects (torch, vLLM) turn into imports and deprecation warnings.
    live = [o for o in gc.get_objects() if type(o) is Config]
    return live[-1] if live else None


_GUARD = _ExitGuard()


def install_exit_guard(config: Any = None) -> None:
    """Make this process end with ``os._exit(<its real status>)`` (see the module doc).

    Idempotent. Pass the pytest ``config`` when at hand; otherwise it is looked up once.
    """
    _GUARD.install(config)


# --------------------------------------------------------------------------- P handle


class NixlProducerHandle(ProducerHandleBase):
    """The P process and its line protocol (see :mod:`kvfail.peers.nixl_producer`)."""

    prefix = PREFIX
    ready_key = "engine_id"

    def __init__(
        self,
        *,
        connector: str = "NixlConnector",
        connector_module: str | None = None,
        engine_id: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        num_blocks: int = 64,
    ) -> None:
        self.port = free_port()
        self.engine_id = engine_id or f"P-nixl-{self.port}"
        env = {
            **NIXL_ENV,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            "PYTHONPATH": _pythonpath(),
        }
        self._spawn(
            "kvfail.peers.nixl_producer",
            f"nixl-P-{self.port}",
            env,
            connector=connector,
            connector_module=connector_module,
            extra_config=extra_config,
            num_blocks=num_blocks,
        )

    def prefill(self, req_id: str, prompt_len: int, prompt_seed: str) -> dict[str, Any]:
        """Run P's half of a request; returns upstream's ``kv_transfer_params`` for D."""
        reply = self.request(
            {
                "cmd": "prefill",
                "req_id": req_id,
                "prompt_len": prompt_len,
                "prompt_seed": prompt_seed,
            }
        )
        return dict(reply["kv_transfer_params"])


def _pythonpath() -> str:
    """The repository root first (``connectors.nixl`` must import in P), then the rest."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


# --------------------------------------------------------------------------- D side


@dataclass
class DecodeRecord:
    """What D observed for one request it added."""

    req_id: str
    prompt_seed: str
    prompt_len: int
    params: dict[str, Any]
    added_at: float
    #: When the fault was injected (default: when the request was added).
    injected_at: float | None = None
    #: Seconds from injection (or add) to the first scheduler report naming the request.
    reported_s: float | None = None
    #: D engine steps from injection to that report.
    reported_steps: int | None = None
    failed: bool = False
    #: Bytes check at the first step the request ran after its load; None: never ran.
    verified: bool | None = None
    #: ``rank<r>:<layer>`` -> first bad positions; ``rank<r>`` with none: computed locally.
    mismatches: dict[str, list[int]] = field(default_factory=dict)
    checked_ranks: set[int] = field(default_factory=set)
    steps_at_injection: int = 0


class NixlPair(PeerPair):
    """P (subprocess) + D engines (this process), real NIXL pull connectors on both sides.

    ``connector``/``connector_module`` pick D's connector (upstream ``NixlConnector``, or
    ``KvfailNixlConnector`` from ``connectors.nixl``); P runs ``p_connector`` (default
    upstream's: a D-side test must not depend on kvfail's P). Always :meth:`close` (or use
    ``with``): it closes every D engine and P's whole process group.
    """

    transport = "nixl"
    #: Reaping a vLLM process took > 5 s under load.
    kill_timeout_s = 30.0

    def __init__(
        self,
        *,
        policy: str = "fail",
        connector: str = "NixlConnector",
        connector_module: str | None = None,
        p_connector: str = "NixlConnector",
        p_connector_module: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
        ready_timeout_s: float = 240.0,
        num_blocks: int = 64,
        build_default_consumer: bool = True,
    ) -> None:
        reason = nixl_available()
        if reason is not None:
            raise RuntimeError(reason)
        self.connector = connector
        self.connector_module = connector_module
        self.extra_config = dict(extra_config or {})
        self.num_blocks = num_blocks
        self.ready_timeout_s = ready_timeout_s
        self._p_kwargs: dict[str, Any] = {
            "connector": p_connector,
            "connector_module": p_connector_module,
            "num_blocks": num_blocks,
        }
        for key, value in NIXL_ENV.items():
            os.environ.setdefault(key, value)
        self._init_common()
        self.records: dict[str, DecodeRecord] = {}
        self._seen: dict[int, int] = {}
        self.p: NixlProducerHandle | None = None
        self.d: Engine | None = None
        try:
            # P imports vLLM in its own process while D builds here: overlap the two.
            self.p = NixlProducerHandle(**self._p_kwargs)
            if build_default_consumer:
                self.d = self.consumer(policy)
            self.p.wait_ready(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ engines

    def consumer(
        self,
        policy: str = "fail",
        *,
        name: str | None = None,
        connector: str | None = None,
        connector_module: str | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ) -> Engine:
        """The D engine called ``name`` (default: the policy's name), built on first use.

        Each D gets its own side-channel port (read from the environment when its
        scheduler connector is built) and its own nixl agent; a fresh name is a D that
        never talked to P ("cold"). ``connector``/``extra_config`` override the pair's.
        """
        key = name or policy
        if key in self.decoders:
            return self.decoders[key]
        from kvfail.harness import Engine

        install_exit_guard()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        spec = self._consumer_spec(
            key,
            policy,
            connector=connector or self.connector,
            connector_module=connector_module if connector is not None else self.connector_module,
            extra_config={**self.extra_config, **dict(extra_config or {})},
        )
        mask = os.sched_getaffinity(0)
        engine = Engine(spec, forward=self._decode_forward)
        restore_affinity(mask)  # vLLM's CPU worker pinned this process to one core
        self._seen[id(engine)] = 0
        return self._register(key, engine)

    def restart_p(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Replace P with a fresh process on a new side-channel port.

        ``wait=False`` only spawns it (its vLLM import overlaps whatever runs next); the
        next call that needs P waits for it (:meth:`producer`).
        """
        if self.p is not None:
            self.p.close()
        self.p = NixlProducerHandle(**self._p_kwargs)
        return self.p.wait_ready(self.ready_timeout_s) if wait else None

    def producer(self) -> NixlProducerHandle:
        producer: NixlProducerHandle = self._ready_producer()
        return producer

    # ------------------------------------------------------------------ requests

    def prefill(
        self, req_id: str, prompt_len: int = 100, prompt_seed: str | None = None
    ) -> dict[str, Any]:
        """P's half only; returns the params D gets (break them, then :meth:`add`)."""
        return self.producer().prefill(req_id, prompt_len, prompt_seed or req_id)

    def _new_record(
        self, engine: Engine, req_id: str, seed: str, prompt_len: int, params: dict
    ) -> DecodeRecord:
        now = time.monotonic()
        record = DecodeRecord(req_id, seed, prompt_len, params, now, now)
        record.steps_at_injection = engine.record.steps
        return record

    def handshaked(self, engine: Engine) -> bool:
        """Every D worker of ``engine`` holds P's remote agent (the handshake is done)."""
        if self.p is None:
            return False
        for worker in engine.workers:
            nixl_worker = getattr(worker.connector, "connector_worker", None)
            agents = getattr(nixl_worker, "_remote_agents", {})
            if not agents.get(self.p.engine_id):
                return False
        return True

    def fault_after_handshake(
        self,
        req_id: str,
        fault: str,
        *,
        consumer: str | Engine | None = None,
        timeout_s: float = 15.0,
    ) -> bool:
        """Kill (``"kill"``) or stop (``"freeze"``) P after D's handshake, before its READ.

        Call right after :meth:`add`. If D has not handshaked with P yet, D is stepped
        once (which schedules the load; upstream handshakes in a background thread and
        posts the READ in a later step) and this waits, without stepping, until the
        handshake is done. The request's clock restarts at the injection. Returns
        whether the handshake was seen before the fault (False: it was injected anyway
        after ``timeout_s``, so the fault hit the handshake instead).
        """
        engine = self._engine(consumer)
        seen = True
        if not self.handshaked(engine):
            engine.step()
            self.observe(engine)
            end = time.monotonic() + timeout_s
            while not self.handshaked(engine) and time.monotonic() < end:
                time.sleep(0.005)
            seen = self.handshaked(engine)
        if fault == "kill":
            self.kill_p()
        elif fault == "freeze":
            self.freeze_p()
        else:
            raise ValueError(f"unknown fault {fault!r}: kill | freeze")
        rec = self.records.get(req_id)
        if rec is not None:
            rec.injected_at = time.monotonic()
            rec.steps_at_injection = engine.record.steps
        return seen

    def run(
        self,
        req_ids: Iterable[str] | None = None,
        *,
        consumer: str | Engine | None = None,
        timeout_s: float = 30.0,
        poll_s: float = 0.005,
    ) -> RunResult:
        """Step D until these requests (default: all of its) are gone; bounded by
        ``timeout_s``, never raises for a crash (``reason="crash"``). Stamps each
        request's detection time (:attr:`DecodeRecord.reported_s`) and failure flag."""
        engine = self._engine(consumer)
        wanted = set(engine.requests) if req_ids is None else set(req_ids)

        def done(e: Engine) -> bool:
            self.observe(e)
            return not (wanted & set(e.scheduler.requests))

        return engine.run_until(done, max_steps=10**9, timeout_s=timeout_s, poll_s=poll_s)

    def observe(self, engine: Engine) -> None:
        """Stamp detection times from ``engine``'s scheduler reports not seen yet; call
        after every step of a D stepped elsewhere (the conformance suite steps its own)."""
        seen = self._seen.get(id(engine), 0)
        reports = engine.record.kv_reports
        self._stamp_reports(reports[seen:], time.monotonic())
        self._seen[id(engine)] = len(reports)

    def _stamp(self, rec: DecodeRecord, report: Any, now: float) -> None:
        """Detection time from the injection (default: the add), and in D steps."""
        start = rec.injected_at if rec.injected_at is not None else rec.added_at
        rec.reported_s = round(now - start, 4)
        rec.reported_steps = report.step + 1 - rec.steps_at_injection

    def _decode_forward(self, engine: Engine, worker: Worker, so: SchedulerOutput) -> None:
        self._check_loaded(engine, worker, so)

    # ------------------------------------------------------------------ faults

    def _close_extra(self) -> None:
        self.d = None

    def __enter__(self) -> NixlPair:
        return self
