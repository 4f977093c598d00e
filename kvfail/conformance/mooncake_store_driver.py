"""The conformance driver for vLLM's ``MooncakeStoreConnector``
(``--connector vllm:MooncakeStoreConnector``).

MooncakeStoreConnector does not pull from a P: P puts each block of a prompt into a
Mooncake distributed store under a key derived from the block hash, and a D with the same
prompt looks the keys up through the store's master and gets the blocks into its own KV
tensors, asynchronously, in receive threads. Why a driver of its own: the processes a load
depends on are the store's (its master, the owner of the memory segment the blocks live
in), and their faults are not a P's.

What runs, all on 127.0.0.1:

* ``mooncake_master`` (the installed non-CUDA wheel's), a real process with its HTTP
  metadata server, started by :meth:`MooncakeStoreDriver.start`;
* the segment owner: a real process (``python -m kvfail.peers.store_segment``) that mounts
  the memory segment P's puts go to (P names it as its preferred segment), so killing it
  takes the stored blocks away from D;
* P: a harness engine in this process running the same connector as producer (the real
  save path: ``wait_for_save`` hands the blocks to its sending thread, which puts them);
* D: a fresh harness engine per scenario, consumer, with ``lookup_async`` on (a setting of
  the connector): the lookup answers in one step and the load starts in the next, so a
  fault can come between them, as it does when a store fails under a running D.

Both forwards write the per-token pattern of :mod:`kvfail.conformance.store_driver`, so
the integrity oracle tells whether D ran on P's bytes. One save call records a
``torch.cuda.Event``, which CPU torch cannot build: P's steps run with a no-op event (rig
patch ``cpu_cuda_event``; D, a consumer, never saves).

Fault points (provoked after D's lookup answered, before D's load starts):
``store_master_killed``, ``store_master_frozen`` (SIGSTOP: only a deadline of D's can end
the load), ``store_master_restarted`` (killed and started again, empty),
``store_key_removed`` (every stored key removed through the master),
``store_key_evicted`` (only the key of the prefix's last stored block removed, as an
eviction would: the other blocks still load),
``store_segment_owner_killed``. TP 1, one KV-cache group.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfail.conformance.claims import DriverClaim, Probe
from kvfail.conformance.driver import Claim, Declared, Injector, Provocation
from kvfail.conformance.store_driver import ExampleDriver, write_pattern
from kvfail.faults.points import FaultPoint
from kvfail.rig.environ import environ_set

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.rig.processes import PeerProcess

__all__ = [
    "MooncakeStoreDriver",
    "cpu_cuda_event",
    "make_driver",
]

#: Bounds: a process coming up, P's puts landing, D's lookup answering.
READY_TIMEOUT_S = 60.0
SAVE_TIMEOUT_S = 20.0
LOOKUP_STEPS = 50
#: P's prefill-and-put is tried this often before the driver gives up on the set-up.
SAVE_TRIES = 3
#: Per-process sizes: small, so several stores fit in a small machine's memory.
SEGMENT_SIZE = "32MB"
#: Each engine's lookup channel is an IPC path named by this number, in a directory every
#: process of the machine shares: a number another process also uses makes D ask that
#: process's store (a second bind takes the path over). So the number holds this process's
#: whole pid, then a count: unique on the machine, not only in this process.
_LOOKUP_PORTS = itertools.count(os.getpid() * 100_000)


class _NoCudaEvent:
    """What the save path's ``torch.cuda.Event`` does on CPU: nothing to wait for."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def cpu_cuda_event() -> Iterator[None]:
    """``torch.cuda.Event`` is a no-op event inside the block, on CPU-only torch only."""
    import torch

    from kvfail.rig import patches as rig_patches

    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.Event
    torch.cuda.Event = _NoCudaEvent  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.cuda.Event = saved  # type: ignore[misc]
        rig_patches.record("cpu_cuda_event", "P's save steps")


class MooncakeStoreDriver(ExampleDriver):
    """vLLM's MooncakeStoreConnector over a real master and segment owner (see the module
    docstring). The P-in-this-process and integrity oracle are the ExampleDriver's.

    ``connector_cls``: a subclass to run on D instead (a negative control); P always runs
    the registered connector."""

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector whose code imports the Mooncake store client (``mooncake.store``):
        its loads depend on this driver's master and segment owner."""
        store = [m for m in probe.imports_from("mooncake") if m.startswith("mooncake.store")]
        if not store:
            return None
        return DriverClaim(
            f"imports {store[0]} (a Mooncake distributed store client); P runs "
            "MooncakeStoreConnector",
            lambda name: cls(name, connector_cls=probe.cls),
        )

    D_CONNECTOR = "MooncakeStoreConnector"

    def __init__(self, name: str, *, connector_cls: type | None = None) -> None:
        super().__init__(name, connector_cls=connector_cls)
        self.poll_s = 0.01
        self._master: PeerProcess | None = None
        self._owner: PeerProcess | None = None
        self._owner_segment = ""
        self._ports: tuple[int, int, int] | None = None
        #: What the connector and the segment owner read their store from.
        self._env: dict[str, str] = {}
        #: A fault that changed the store: the next scenario gets a fresh one.
        self._dirty = False
        #: D engines of the running scenario (their lookup channels are closed after it).
        self._engines: list[Engine] = []

    # ------------------------------------------------------------ processes

    def _start_master(self) -> None:
        self._spawn_master()
        self._await_master()

    def _spawn_master(self) -> None:
        """Start ``mooncake_master`` on this store's ports; :meth:`_await_master` waits
        until it listens (it takes about a second, asleep: other work can go on)."""
        from kvfail.rig.processes import PeerProcess

        assert self._ports is not None
        rpc, http, metrics = self._ports
        binary = Path(sys.executable).with_name("mooncake_master")
        self._master = PeerProcess(
            [
                str(binary),
                f"--rpc_port={rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={http}",
                "--http_metadata_server_host=127.0.0.1",
                f"--metrics_port={metrics}",
                "--metrics_host=127.0.0.1",
            ],
            name="mooncake_master",
        )

    def _await_master(self) -> None:
        from kvfail.rig.ports import wait_for_port

        assert self._ports is not None
        rpc, http, _metrics = self._ports
        wait_for_port(rpc, READY_TIMEOUT_S, peer=self._master)
        wait_for_port(http, READY_TIMEOUT_S, peer=self._master)

    def _start_owner(self) -> None:
        from kvfail.rig.processes import PeerProcess

        self._owner = PeerProcess(
            [sys.executable, "-m", "kvfail.peers.store_segment", "--size", SEGMENT_SIZE],
            name="store_segment",
            env=self._env,
        )
        line = self._owner.wait_ready(READY_TIMEOUT_S, line="segment ")
        assert line is not None
        self._owner_segment = line.split("segment ", 1)[1].strip()

    def start(self) -> None:
        super().start()
        if self._master is not None:
            return
        self._new_store()
        self._start_master()
        self._start_owner()

    def _new_store(self) -> None:
        """Ports and a configuration for a store of its own: what the next master, segment
        owner and engines built from now on use (each reads it once, at start)."""
        from kvfail.rig.ports import free_ports

        self._ports = tuple(free_ports(3))  # type: ignore[assignment]
        rpc, http, _metrics = self._ports  # type: ignore[misc]
        config = {
            "metadata_server": f"http://127.0.0.1:{http}/metadata",
            "master_server_address": f"127.0.0.1:{rpc}",
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": SEGMENT_SIZE,
            "local_buffer_size": SEGMENT_SIZE,
        }
        path = self.root / f"mooncake-store-{rpc}.json"
        path.write_text(json.dumps(config))
        self._env = {"MOONCAKE_CONFIG_PATH": str(path), "VLLM_HOST_IP": "127.0.0.1"}

    @contextlib.contextmanager
    def _environment(self) -> Iterator[None]:
        """This driver's store in the environment, while an engine is built: the
        connector's worker reads its store configuration from the environment in its
        constructor only, and several drivers (a reference and its control) may each
        run a store in one session."""
        with environ_set(self._env):
            yield

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        self.start()
        with self._environment():
            engine = super().build_engine(
                policy, num_kv_cache_groups=num_kv_cache_groups, tp_size=tp_size, deadline=deadline
            )
        self._engines.append(engine)
        return engine

    @staticmethod
    def _close(engine: Engine) -> None:
        """Close ``engine`` and the lookup client its connector leaves open.

        Why: the connector's shutdown closes the store, not the ZMQ REQ socket its
        scheduler side sends lookups on. Left to the garbage collector, the socket's
        context is destroyed with the socket open (a lookup may still be unanswered), and
        ``zmq.Context.term`` blocks the process for good. (Rank 0's REP side is held by
        its serving thread, so it is never collected.)"""
        engine.close()
        sched = getattr(engine.scheduler.connector, "connector_scheduler", None)
        client = getattr(sched, "client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def stop(self) -> None:
        try:
            for engine in self._engines:
                self._close(engine)
            self._engines.clear()
            if self._p is not None:
                self._close(self._p)
                self._p = None
            self._stop_processes()
        finally:
            super().stop()

    def end_faults(self, engine: Engine) -> None:
        """A frozen master resumes (a killed one stays dead)."""
        if self._master is not None and self._master.alive and self._master.frozen:
            self._master.thaw()

    def before_close(self) -> None:
        """A master the scenario killed is started again, empty, on its ports: each
        engine's store client unmounts its segments from the master at shutdown, and
        with none listening it waits out its RPC retries (seconds per engine). The store
        is replaced after the scenario all the same."""
        if self._master is not None and not self._master.alive:
            self._master.close()
            self._start_master()

    def after_scenario(self) -> None:
        """The scenario's D engines are closed: release their lookup channels. After a
        fault on the store's processes, the next scenario gets a fresh store: a new
        master and segment owner, and a P that registers with them."""
        super().after_scenario()
        for engine in self._engines:
            self._close(engine)
        self._engines.clear()
        if not self._dirty:
            return
        self._dirty = False
        # The new store gets ports and a master of its own at once: the master's start
        # (mostly asleep) overlaps P's close and the old processes' stop.
        old = (self._owner, self._master)
        self._owner = self._master = None
        try:
            self._new_store()
            self._spawn_master()
            if self._p is not None:
                with contextlib.suppress(Exception):
                    self._close(self._p)
                self._p = None
        finally:
            self._stop_processes(*old)
        self._await_master()
        self._start_owner()

    def _stop_processes(self, *procs: PeerProcess | None) -> None:
        """Stop ``procs`` (default: the segment owner and the master; a frozen one is
        thawed first)."""
        if not procs:
            procs = (self._owner, self._master)
            self._owner = self._master = None
        for proc in procs:
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.thaw()
                proc.close()

    # ------------------------------------------------------------ capabilities

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        """Each breaks the store between D's lookup (answered in
        :meth:`add_remote_request`) and D's load (D's next step); the next scenario gets
        a fresh store."""

        def breaks(how: Callable[[Provocation], object]) -> Injector:
            return Injector(provoke=lambda call: self._break_store(how, call))

        return {
            FaultPoint.STORE_MASTER_KILLED: breaks(lambda call: self._master_proc.kill()),
            FaultPoint.STORE_MASTER_FROZEN: breaks(lambda call: self._master_proc.freeze()),
            FaultPoint.STORE_MASTER_RESTARTED: breaks(lambda call: self._restart_master()),
            FaultPoint.STORE_KEY_REMOVED: breaks(lambda call: self._remove_all_keys()),
            FaultPoint.STORE_KEY_EVICTED: breaks(
                lambda call: self._evict_last_block(call.engine, call.request_id)
            ),
            FaultPoint.STORE_SEGMENT_OWNER_KILLED: breaks(lambda call: self._owner_proc.kill()),
        }

    def _break_store(self, how: Callable[[Provocation], object], call: Provocation) -> None:
        self._dirty = True
        how(call)

    @property
    def _master_proc(self) -> PeerProcess:
        assert self._master is not None, "the store is not started"
        return self._master

    @property
    def _owner_proc(self) -> PeerProcess:
        assert self._owner is not None, "the store is not started"
        return self._owner

    def _restart_master(self) -> None:
        """Killed and started again, empty."""
        self._master_proc.kill()
        self._master_proc.close()
        self._start_master()

    def _remove_all_keys(self) -> None:
        store = self._producer().workers[0].connector.connector_worker.store
        if store.remove_all(force=True) < 0:
            raise RuntimeError("MooncakeStoreDriver: the master refused to remove the keys")

    def declared(self) -> Declared:
        """The file store's claims (one KV-cache group, TP 1, as built there), but for
        how this store loads and what is behind it."""
        return replace(
            super().declared(),
            async_load=Claim(True, "receive threads get the blocks; D reports them finished later"),
            sync_load=Claim(False, "the connector loads asynchronously (load_async)"),
            remote_prefill=Claim(
                True,
                "P, a harness engine, puts real blocks into a real Mooncake store",
            ),
            real_transport=Claim(
                True,
                "mooncake_master and a segment-owner process, TransferEngine over TCP",
            ),
        )

    # ------------------------------------------------------------ engines

    def _spec(
        self,
        policy: Policy,
        role: str,
        connector: str = "MooncakeStoreConnector",
        module: str | None = None,
    ) -> EngineSpec:
        extra: dict[str, Any] = {"lookup_rpc_port": next(_LOOKUP_PORTS)}
        if role == "consumer":
            extra["lookup_async"] = True
        else:
            extra["preferred_segment"] = self._owner_segment
        return self._store_spec(policy, role, connector, module, extra)

    def _producer(self) -> Engine:
        if self._p is None:
            from kvfail.harness.engine import Engine

            self.start()
            with cpu_cuda_event(), self._environment():
                self._p = Engine(self._spec("fail", "producer"), forward=write_pattern)
        return self._p

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """P prefills the prompt and its blocks are put into the store; then D gets the
        same prompt (its lookup finds them)."""
        p = self._producer()
        for attempt in range(SAVE_TRIES):
            stored = self._prefill_and_put(p, f"P-{request_id}-{attempt}", request_id, prompt_len)
            if stored:
                break
        else:
            raise RuntimeError(
                f"MooncakeStoreDriver: P's puts for {request_id} did not reach the store "
                f"({SAVE_TRIES} tries; P's log says why)"
            )
        engine.add_request(
            request_id, prompt_len=prompt_len, prompt_seed=request_id, max_tokens=max_tokens
        )
        self._await_lookup(engine, request_id)
        return request_id

    def _prefill_and_put(self, p: Engine, p_request: str, seed: str, prompt_len: int) -> bool:
        """P prefills the prompt seeded by ``seed`` and its sender puts the blocks; True
        when P's own lookup then finds them. A put can fail on a loaded machine (P only
        logs it), and D's lookup would then match nothing: a set-up that did not happen,
        so the driver puts again rather than hand the scenario a request with no load."""
        p.add_request(p_request, prompt_len=prompt_len, prompt_seed=seed)
        with cpu_cuda_event():
            p.run_until_idle(max_steps=20)
        if p.crashed is not None:
            raise RuntimeError(f"MooncakeStoreDriver: P crashed saving {seed}: {p.crashed}")
        worker = p.workers[0].connector.connector_worker
        sender = worker.kv_send_thread
        deadline = time.monotonic() + SAVE_TIMEOUT_S
        while sender is not None and sender.request_queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"MooncakeStoreDriver: P's puts for {seed} never ended")
            time.sleep(0.01)
        found = worker.lookup(prompt_len, p.requests[p_request].block_hashes)
        return getattr(found, "hit_length", 0) > 0

    def _await_lookup(self, engine: Engine, request_id: str) -> None:
        """Step D until its asynchronous lookup of ``request_id`` has answered, and no
        further: the load starts in D's next step, so a fault provoked now comes between
        the lookup and the load. Why here and not in the suite's steps: the lookup runs
        in real time (an IPC round trip and a master RPC), which a few fast steps do not
        give it."""
        client = engine.scheduler.connector.connector_scheduler.client
        deadline = time.monotonic() + SAVE_TIMEOUT_S
        for _ in range(LOOKUP_STEPS):
            future = client.futures.get(request_id)
            if future is not None:
                try:
                    found = future.result(timeout=max(deadline - time.monotonic(), 0.0))
                except Exception as e:
                    raise RuntimeError(
                        f"MooncakeStoreDriver: D's lookup of {request_id} did not answer: {e!r}"
                    ) from e
                if getattr(found, "hit_length", 1) <= 0:
                    # Without a hit D computes the prompt itself and no fault provoked
                    # next can be seen: a precondition that did not hold, not a verdict.
                    raise RuntimeError(
                        f"MooncakeStoreDriver: D's lookup of {request_id} matched nothing, "
                        "though P's own lookup found its blocks (D's log says why)"
                    )
                return
            if request_id in engine.waiting_for_remote() or engine.crashed is not None:
                return
            engine.step()
        raise RuntimeError(f"MooncakeStoreDriver: D's lookup of {request_id} never started")

    def _evict_last_block(self, engine: Engine, request_id: str) -> None:
        """Remove, through the master, the keys of the last block of ``request_id``'s
        prompt the store holds (every key ends in ``@<block hash>``); the others stay."""
        import re

        store = self._producer().workers[0].connector.connector_worker.store
        hashes = engine.scheduler.requests[request_id].block_hashes
        for block_hash in reversed(hashes):
            pattern = f".*@{re.escape(bytes(block_hash).hex())}$"
            if store.remove_by_regex(pattern, force=True) > 0:
                return
        raise RuntimeError(f"MooncakeStoreDriver: no stored key of {request_id} to evict")


def make_driver(name: str) -> MooncakeStoreDriver:
    """Entry point ``kvfail.drivers`` ``vllm:MooncakeStoreConnector``."""
    return MooncakeStoreDriver(name)
