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
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.faults import PeerProcess, free_port
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


def _closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wrong_port(params: Mapping[str, Any], port: int | None = None) -> dict[str, Any]:
    """``params`` with a side-channel port nobody listens on (handshake times out, 5 s)."""
    out = dict(params)
    out["remote_port"] = port or _closed_port()
    return out


def unknown_engine(params: Mapping[str, Any], engine_id: str = "no-such-engine") -> dict[str, Any]:
    """``params`` naming an engine id other than the one P's side channel answers for."""
    out = dict(params)
    out["remote_engine_id"] = engine_id
    return out


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


class NixlProducerHandle:
    """The P process and its line protocol (see :mod:`kvfail.peers.nixl_producer`)."""

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
        config = {
            "connector": connector,
            "connector_module": connector_module,
            "engine_id": self.engine_id,
            "extra_config": dict(extra_config or {}),
            "num_blocks": num_blocks,
        }
        env = {
            **NIXL_ENV,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            "PYTHONPATH": _pythonpath(),
        }
        self.started_at = time.monotonic()
        self.process = PeerProcess(
            [sys.executable, "-m", "kvfail.peers.nixl_producer", "--config", json.dumps(config)],
            name=f"nixl-P-{self.port}",
            env=env,
            stdin=True,
        )
        self.ready: dict[str, Any] | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def wait_ready(self, timeout_s: float = 240.0) -> dict[str, Any]:
        """Block until P printed its ready event (vLLM import: 15-80 s on a busy machine)."""
        if self.ready is None:
            line = self.process.wait_ready(timeout_s, line=PREFIX + '{"engine_id"')
            assert line is not None
            self.ready = json.loads(line[line.index(PREFIX) + len(PREFIX) :])
            self.ready["ready_s"] = round(time.monotonic() - self.started_at, 3)
        return self.ready

    def request(self, cmd: Mapping[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one command and wait (bounded) for its reply; raises if P does not answer."""
        with self._lock:
            rid = next(self._ids)
            self.process.write_stdin(json.dumps({**cmd, "id": rid}) + "\n")
            # Replies are json.dumps(sort_keys=True): '"id": N,' is unique per reply.
            line = self.process.wait_ready(timeout_s, line=f'"id": {rid},')
        assert line is not None
        reply: dict[str, Any] = json.loads(line[line.index(PREFIX) + len(PREFIX) :])
        if not reply.get("ok"):
            raise RuntimeError(f"P refused {cmd.get('cmd')}: {reply.get('error')}")
        return reply

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

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self.request({"cmd": "stats"}, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask P to quit cleanly; kill its group if it cannot (dead, frozen, stuck)."""
        proc = self.process
        if proc.alive and not proc.frozen:
            with contextlib.suppress(Exception):
                proc.write_stdin('{"cmd": "quit"}\n')
                proc.wait(timeout_s)
        proc.close()


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


class NixlPair:
    """P (subprocess) + D engines (this process), real NIXL pull connectors on both sides.

    ``connector``/``connector_module`` pick D's connector (upstream ``NixlConnector``, or
    ``KvfailNixlConnector`` from ``connectors.nixl``); P runs ``p_connector`` (default
    upstream's: a D-side test must not depend on kvfail's P). Always :meth:`close` (or use
    ``with``): it closes every D engine and P's whole process group.
    """

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
        self.records: dict[str, DecodeRecord] = {}
        self.decoders: dict[str, Engine] = {}
        self._seen: dict[int, int] = {}
        self._seq = itertools.count()
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
        from kvfail.harness import Engine, EngineSpec

        install_exit_guard()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        spec = EngineSpec(
            role="consumer",
            connector=connector or self.connector,
            connector_module=connector_module if connector is not None else self.connector_module,
            policy=policy,  # type: ignore[arg-type]
            engine_id=f"D-nixl-{key}-{os.getpid()}-{next(self._seq)}",
            extra_config={**self.extra_config, **dict(extra_config or {})},
            num_blocks=self.num_blocks,
        )
        mask = os.sched_getaffinity(0)
        engine = Engine(spec, forward=self._decode_forward)
        restore_affinity(mask)  # vLLM's CPU worker pinned this process to one core
        self.decoders[key] = engine
        self._seen[id(engine)] = 0
        return engine

    def _engine(self, consumer: str | Engine | None) -> Engine:
        if consumer is None:
            if self.d is None:
                raise RuntimeError("no default consumer; build one with consumer()")
            return self.d
        if not isinstance(consumer, str):
            return consumer
        if consumer not in self.decoders:
            raise KeyError(f"no consumer {consumer!r}; build it with consumer()")
        return self.decoders[consumer]

    def restart_p(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Replace P with a fresh process on a new side-channel port.

        ``wait=False`` only spawns it (its vLLM import overlaps whatever runs next); the
        next call that needs P waits for it (:meth:`producer`).
        """
        if self.p is not None:
            self.p.close()
        self.p = NixlProducerHandle(**self._p_kwargs)
        return self.p.wait_ready(self.ready_timeout_s) if wait else None

    @property
    def p_usable(self) -> bool:
        """P's process is alive and not stopped (it may still be importing vLLM)."""
        return self.p is not None and self.p.process.alive and not self.p.process.frozen

    def producer(self) -> NixlProducerHandle:
        if self.p is None:
            raise RuntimeError("no P process")
        if self.p.ready is None and self.p.process.alive:
            self.p.wait_ready(self.ready_timeout_s)
        return self.p

    # ------------------------------------------------------------------ requests

    def prefill(
        self, req_id: str, prompt_len: int = 100, prompt_seed: str | None = None
    ) -> dict[str, Any]:
        """P's half only; returns the params D gets (break them, then :meth:`add`)."""
        return self.producer().prefill(req_id, prompt_len, prompt_seed or req_id)

    def add(
        self,
        req_id: str,
        params: Mapping[str, Any],
        *,
        prompt_len: int = 100,
        prompt_seed: str | None = None,
        max_tokens: int = 4,
        consumer: str | Engine | None = None,
    ) -> DecodeRecord:
        """Add D's request with these ``kv_transfer_params`` (the prompt must match P's)."""
        engine = self._engine(consumer)
        seed = prompt_seed or req_id
        now = time.monotonic()
        record = DecodeRecord(req_id, seed, prompt_len, dict(params), now, now)
        record.steps_at_injection = engine.record.steps
        self.records[req_id] = record
        engine.add_request(
            req_id,
            prompt_len=prompt_len,
            prompt_seed=seed,
            max_tokens=max_tokens,
            kv_transfer_params=dict(params),
        )
        return record

    def prefill_and_add(
        self,
        req_id: str,
        prompt_len: int = 100,
        *,
        prompt_seed: str | None = None,
        max_tokens: int = 4,
        consumer: str | Engine | None = None,
    ) -> DecodeRecord:
        """P prefills, then D adds the request with P's params: a normal P->D pull."""
        params = self.prefill(req_id, prompt_len, prompt_seed)
        return self.add(
            req_id,
            params,
            prompt_len=prompt_len,
            prompt_seed=prompt_seed,
            max_tokens=max_tokens,
            consumer=consumer,
        )

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
        now = time.monotonic()
        seen = self._seen.get(id(engine), 0)
        reports = engine.record.kv_reports
        for report in reports[seen:]:
            if report.rank is not None:
                continue
            for rid in report.failed_requests | report.finished_recving:
                rec = self.records.get(rid)
                if rec is None:
                    continue
                if rec.reported_s is None:
                    start = rec.injected_at if rec.injected_at is not None else rec.added_at
                    rec.reported_s = round(now - start, 4)
                    rec.reported_steps = report.step + 1 - rec.steps_at_injection
                if rid in report.failed_requests:
                    rec.failed = True
        self._seen[id(engine)] = len(reports)

    def verify(self, req_id: str) -> bool:
        """True iff D's KV blocks held exactly P's pattern for every pulled token."""
        rec = self.records.get(req_id)
        return bool(rec is not None and rec.verified)

    def _decode_forward(self, engine: Engine, worker: Worker, so: SchedulerOutput) -> None:
        from kvfail.peers.pattern import mismatched_positions

        manager = engine.scheduler.kv_cache_manager
        for req_id, n in so.num_scheduled_tokens.items():
            rec = self.records.get(req_id)
            if rec is None or worker.rank in rec.checked_ranks:
                continue
            rec.checked_ranks.add(worker.rank)
            request = engine.scheduler.requests[req_id]
            # schedule() already advanced num_computed_tokens by this step's tokens; a
            # request that starts from 0 was computed locally (no load, or recompute).
            loaded = min(request.num_computed_tokens - n, rec.prompt_len)
            if loaded == 0:
                rec.mismatches[f"rank{worker.rank}"] = []
                rec.verified = False
                continue
            block_ids = manager.get_block_ids(req_id)[0]
            for layer, name in enumerate(engine.built.layer_names):
                wrong = mismatched_positions(
                    worker.kv_caches[name], layer, block_ids, 0, loaded, rec.prompt_seed
                )
                if wrong:
                    rec.mismatches[f"rank{worker.rank}:{name}"] = wrong[:8]
            rec.verified = not rec.mismatches

    # ------------------------------------------------------------------ faults

    def kill_p(self) -> int:
        """SIGKILL P's process group (a crash: UCX sees the endpoint go). Waits until the
        group is gone: up to 30 s, since reaping a vLLM process took > 5 s under load."""
        return self.producer().process.kill(timeout_s=30.0)

    def freeze_p(self) -> None:
        """SIGSTOP P's group: a silent peer whose sockets stay open."""
        self.producer().process.freeze()

    def thaw_p(self) -> None:
        self.producer().process.thaw()

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Close D engines and P's process group; idempotent, never raises."""
        for engine in list(self.decoders.values()):
            with contextlib.suppress(Exception):
                engine.close()
        self.decoders.clear()
        self.d = None
        if self.p is not None:
            with contextlib.suppress(Exception):
                self.p.close()

    def __enter__(self) -> NixlPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
