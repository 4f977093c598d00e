"""The ``toy`` driver: :class:`kvfail.harness.toy.ToyConnector`, a labelled in-process
TEST DOUBLE, behind the Driver API.

It exists to test the suite itself fast; it proves nothing about a real transport. It
also drives any ToyConnector subclass, which is how the negative controls
(``kvfail.conformance.negative``) are run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.conformance.claims import DriverClaim, Probe
from kvfail.conformance.driver import (
    Claim,
    Declared,
    Driver,
    EngineHandle,
    Injector,
    LateWriteGate,
    Provocation,
    RemoteBatch,
    abort_request,
)
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.hooks import SplitForward

__all__ = ["ToyDriver", "make_driver"]


class ToyDriver(Driver["_ToyHandle"]):
    """In-process driver for ``ToyConnector`` and its subclasses (a TEST DOUBLE).

    Loads run in the toy's ``hold`` mode so the driver decides when each one ends; P is
    played by writing a seeded byte pattern into the toy's in-memory transport, so D's
    blocks can be compared with it afterwards.

    ``net_delay``: the in-memory P answers by itself, :attr:`DELAY_STEPS` D steps after
    the load was first seen waiting (counted in :meth:`observe`), so a connector that
    fails a load after one step is caught. A toy step takes milliseconds, far below the
    toy's :attr:`DEADLINE_S`; a step count, not a sleep, keeps the delay the same on a
    loaded machine.

    ``kill_one_peer``: peer ``k`` > 0 is a second in-memory P with its own engine id
    (:meth:`remote_engine`). Killing one is what its death looks like at the toy's
    transport boundary: from then on every load from it that is in flight on a worker
    fails with stage ``peer_lost`` (checked after each step, in :meth:`observe`, and at
    :meth:`provoke`); loads from the other P are untouched.

    ``slow_peer_past_deadline``: the in-memory P never answers the load, so only the
    connector's deadline ends it; the toy transport holds a write for it
    (``ToyConnector.hold_write``), so the toy's fence quarantines its blocks. Then,
    :data:`~kvfail.conformance.driver.LATE_WRITE_STEPS` D steps after the load stopped
    waiting (its report reached the scheduler), the write lands
    (``ToyConnector.land_write``): P's bytes go into the blocks the load was given, in
    D's real KV tensors on every rank, wherever the scheduler has them by then: a slow P
    whose write lands after D gave up. Steps, not seconds, as for ``net_delay``.
    """

    #: The toy reporter's watchdog deadline used by the silent-peer scenario.
    DEADLINE_S = 0.5
    #: D steps a ``net_delay`` load waits before the in-memory P answers.
    DELAY_STEPS = 3
    REMOTE_ENGINE = "P-toy"

    def __init__(self, name: str = "toy", connector_cls: type | None = None) -> None:
        from kvfail.harness.toy import ToyConnector
        from kvfail.peers.integrity import IntegrityLedger

        self.name = name
        self.connector_cls = connector_cls or ToyConnector

        #: The KV-integrity oracle; the in-memory P sends every rank the same bytes.
        self._integrity = IntegrityLedger(rank_seeded=False)
        #: Engine ids of the in-memory P's killed in this scenario (``kill_one_peer``).
        self._dead_peers: set[str] = set()

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector that reads ``toy_mode`` from its extra config: it runs on the toy's
        in-memory transport, the one this driver commands."""
        if not probe.reads("toy_mode"):
            return None
        return DriverClaim(
            "reads kv_connector_extra_config 'toy_mode' (the in-memory toy transport)",
            lambda name: cls(name, probe.cls),
        )

    #: ``slow_peer_past_deadline``: the in-memory P writes only once the load was reported.
    slow_peer_delay_s: float | None = None

    @property
    def injectors(self) -> dict[FaultPoint, _ToyInjector]:
        fail = _ToyInjector(provoke=self._fail_load)
        nothing = _ToyInjector()
        return {
            FaultPoint.PEER_ERROR_RESPONSE: fail,  # toy transport reports an error
            FaultPoint.TP_ONE_RANK: fail,  # ... on the ranks the scenario names
            # The named rank's transport never answers; the others are settled.
            FaultPoint.TP_ONE_RANK_FROZEN: nothing,
            FaultPoint.FREEZE_PEER: nothing,  # toy transport never answers
            FaultPoint.ABORT_WHILE_WAITING: _ToyInjector(provoke=abort_request),
            FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS: nothing,  # the scenario's request has no block
            # The in-memory P answers DELAY_STEPS steps late (see observe).
            FaultPoint.NET_DELAY: _ToyInjector(state=_ToyDelay),
            # A second in-memory P, whose loads all fail (see add_remote_requests).
            FaultPoint.KILL_ONE_PEER: _ToyInjector(provoke=self._fail_dead_peers, kills_peer=True),
            # Writes once the load stopped waiting (see observe).
            FaultPoint.SLOW_PEER_PAST_DEADLINE: _ToyInjector(state=_ToyLateWrite),
        }

    def declared(self) -> Declared:
        cls = self.connector_cls.__name__
        return Declared(
            async_load=Claim(True, f"{cls} loads asynchronously (load_kv_async=True)"),
            sync_load=Claim(False, f"{cls} only advertises asynchronous loads"),
            remote_prefill=Claim(True, "the toy transport plays P in memory"),
            two_groups=Claim(True, "the harness builds D with two KV-cache groups"),
            real_transport=Claim(False, f"{cls} is an in-memory test double, not a transport"),
            tp2=Claim(True, "harness simulates TP=2; the toy's reporting is rank-independent"),
            hetero_tp=Claim(False, "the in-memory P has no TP size of its own"),
        )

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        from kvfail.harness.config import EngineSpec

        extra: dict[str, Any] = {"toy_mode": "hold"}
        if deadline:
            extra["toy_deadline_s"] = self.DEADLINE_S
        return EngineSpec(
            connector=self.connector_cls.__name__,
            connector_module=self.connector_cls.__module__,
            policy=policy,
            num_kv_cache_groups=num_kv_cache_groups,
            tp_size=tp_size,
            extra_config=extra,
        )

    def forward(self) -> SplitForward:
        """The integrity oracle (see :mod:`kvfail.peers.integrity`)."""
        return self._integrity.split_forward(on_first=self._on_first)

    def _on_first(
        self, engine: Engine, rank: int, req_id: str, loaded: int, wrong: dict[str, list[int]]
    ) -> None:
        self.handle(engine).first.setdefault(req_id, {})[rank] = (loaded, wrong)

    def new_handle(self, engine: Engine) -> _ToyHandle:
        return _ToyHandle(engine)

    @classmethod
    def remote_engine(cls, peer: int = 0) -> str:
        """The engine id of in-memory P number ``peer`` (0: the driver's P)."""
        return cls.REMOTE_ENGINE if peer == 0 else f"{cls.REMOTE_ENGINE}-{peer + 1}"

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        return self._add(engine, request_id, prompt_len, max_tokens, self.REMOTE_ENGINE)

    def hits_whole_peer(self, fault: FaultPoint | None) -> bool:
        """``kill_one_peer`` kills the in-memory P the batch comes from."""
        injector = None if fault is None else self.injector(fault)
        return isinstance(injector, _ToyInjector) and injector.kills_peer

    def add_from_peer(self, batch: RemoteBatch) -> None:
        """From in-memory P number ``peer``; ``kill_one_peer`` kills that P once it has
        "prefilled" them (its loads fail while in flight, see the class)."""
        kills = self.hits_whole_peer(batch.fault)
        if batch.fault is not None and not kills:
            raise ValueError(f"toy driver: {batch.fault} is not armed on peer {batch.peer}")
        remote = self.remote_engine(batch.peer)
        for request_id in batch.request_ids:
            self._add(batch.engine, request_id, batch.prompt_len, batch.max_tokens, remote)
        if kills:
            self._dead_peers.add(remote)

    def _add(
        self, engine: Engine, request_id: str, prompt_len: int, max_tokens: int, remote: str
    ) -> str:
        """P ``remote``'s prefill into the in-memory transport, then D's request."""
        import torch

        from kvfail.harness.toy import TRANSPORT
        from kvfail.peers.pattern import write_pattern

        block_size = engine.spec.block_size
        num_blocks = max((prompt_len - 1) // block_size, 0)
        worker = engine.workers[0]
        layers = {}
        # P's prefill, as a real P writes it: the pattern of this prompt, token by token.
        for layer, name in enumerate(worker.view(1).built.layer_names):
            cache = worker.kv_caches[name]
            data = torch.zeros((num_blocks, *cache.shape[1:]), dtype=cache.dtype)
            write_pattern(data, layer, range(num_blocks), 0, num_blocks * block_size, request_id)
            layers[name] = data
        TRANSPORT.put((remote, request_id), layers)
        self._integrity.track(engine, request_id, request_id, prompt_len)
        handle = self.handle(engine)
        handle.added_at[request_id] = time.monotonic()
        handle.peer_of[request_id] = remote
        self.take_fault(engine, request_id)  # its state: a delay, a late write (injectors)
        engine.add_request(
            request_id,
            prompt_len=prompt_len,
            prompt_seed=request_id,
            max_tokens=max_tokens,
            kv_transfer_params={
                "do_remote_prefill": True,
                "remote_engine_id": remote,
                "remote_request_id": request_id,
            },
        )
        return request_id

    def add_local_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """A request D computes itself, watched by the integrity oracle (nothing loaded)."""
        self._integrity.track(engine, request_id, request_id, prompt_len)
        return super().add_local_request(
            engine, request_id, prompt_len=prompt_len, max_tokens=max_tokens
        )

    def _workers(self, engine: Engine, ranks: Iterable[int] | None) -> list[Any]:
        wanted = None if ranks is None else set(ranks)
        return [w for w in engine.workers if wanted is None or w.rank in wanted]

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        for worker in self._workers(engine, ranks):
            worker.connector.complete(request_id)

    def _fail_load(self, call: Provocation) -> None:
        """The in-memory P answers the load with an error, on the ranks the call names."""
        from kvfail import Stage

        for worker in self._workers(call.engine, call.ranks):
            worker.connector.fail(
                call.request_id,
                stage=Stage.PEER,
                reason=f"toy: provoked {call.point.value}",
                block_index=call.block_index,
            )

    def _fail_dead_peers(self, call: Provocation) -> None:
        self._fail_loads_of_dead_peers(call.engine)

    def _fail_loads_of_dead_peers(self, engine: Engine) -> None:
        """Fail, on every worker, each load in flight from a killed in-memory P (its
        death as the transport sees it: the peer is gone, not an answer from it)."""
        from kvfail import Stage

        if not self._dead_peers:
            return
        peer_of = self.handle(engine).peer_of
        for worker in engine.workers:
            for req_id in sorted(worker.connector.inflight()):
                remote = peer_of.get(req_id)
                if remote in self._dead_peers:
                    worker.connector.fail(
                        req_id, stage=Stage.PEER_LOST, reason=f"toy: P {remote} was killed"
                    )

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        first = self.handle(engine).first.get(request_id)
        if first is None or set(first) != {w.rank for w in engine.workers}:
            return f"{request_id} never ran on every rank after its load: no bytes were checked"
        for rank, (loaded, wrong) in sorted(first.items()):
            if loaded == 0:
                return f"rank {rank}: {request_id} was computed locally, nothing was loaded"
            if wrong:
                return f"rank {rank}: loaded positions differ from P's: {wrong}"
        return None

    def observe(self, engine: Engine) -> None:
        self._integrity.after_step(engine)
        self._fail_loads_of_dead_peers(engine)
        handle = self.handle(engine)
        # Detection times: when a report first named each request (for detection_s).
        reports = engine.record.kv_reports
        now = time.monotonic()
        for report in reports[handle.reports_read :]:
            if report.rank is None:
                for rid in report.finished_recving | report.failed_recving:
                    handle.reported_s.setdefault(rid, now)
        handle.reports_read = len(reports)
        waiting = engine.waiting_for_remote()
        for rid, fault in list(handle.active.items()):
            if isinstance(fault.state, _ToyLateWrite):
                self._late_write_step(engine, rid, fault.state, waiting)
        # net_delay: the in-memory P answers once the load has waited DELAY_STEPS steps.
        for rid, fault in list(handle.active.items()):
            delay = fault.state
            if not isinstance(delay, _ToyDelay):
                continue
            if rid not in waiting:
                if delay.steps:  # it waited and ended otherwise (failed, aborted)
                    del handle.active[rid]
                continue
            delay.steps += 1
            if delay.steps >= self.DELAY_STEPS:
                del handle.active[rid]
                self.settle(engine, rid)

    def _late_write_step(
        self, engine: Engine, rid: str, late: _ToyLateWrite, waiting: frozenset[str]
    ) -> None:
        """``slow_peer_past_deadline``: note the load each worker started while it waits;
        once its :class:`~kvfail.conformance.driver.LateWriteGate` is due after it stopped
        waiting, write P's bytes into those blocks, on every rank (see the class
        docstring)."""
        if late.done is not None:
            return
        if rid in waiting:
            for worker in engine.workers:
                load = worker.connector._inflight.get(rid)
                if load is not None and worker.rank not in late.loads:
                    late.loads[worker.rank] = load
                    worker.connector.hold_write(rid)  # P's write is on its way
            return
        if not late.loads:
            return  # never in flight on a worker: nothing to write, so never "done"
        if not late.gate.due(engine.record.steps):
            return
        for worker in engine.workers:
            load = late.loads.get(worker.rank)
            if load is not None:
                worker.connector.land_write(rid, load)
        blocks = sorted({b for load in late.loads.values() for g in load.block_ids for b in g})
        late.done = (
            f"the toy's P wrote {rid}'s blocks {blocks} on ranks {sorted(late.loads)}, "
            f"{engine.record.steps - (late.gate.since or 0)} steps after the load stopped waiting"
        )

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        fault = self.handle(engine).active.get(request_id)
        late = None if fault is None else fault.state
        return late.done if isinstance(late, _ToyLateWrite) else None

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        handle = self.handle(engine)
        if request_id not in handle.reported_s or request_id not in handle.added_at:
            return None
        return handle.reported_s[request_id] - handle.added_at[request_id]

    def integrity_findings(self, engine: Engine) -> list[str]:
        return self._integrity.final_findings(engine)

    def wrong_bytes_finding(self, engine: Engine, request_id: str) -> str | None:
        """Never anything but P's bytes: the in-memory P writes only the seeded pattern,
        so a wrong byte is the integrity oracle's (a stray write), not a load's."""
        return None

    def after_scenario(self) -> None:
        self._integrity.engines.clear()  # the scenario's engines are closed
        self._dead_peers.clear()  # the next scenario's second P is a new one

    def stop(self) -> None:
        from kvfail.harness.toy import TRANSPORT

        TRANSPORT.clear()


@dataclass(eq=False)
class _ToyHandle(EngineHandle):
    """A D engine of the toy driver: what the driver timed and checked per request."""

    #: request id -> rank -> (tokens loaded, wrong positions) at its first schedule: the
    #: byte check of what it ran on.
    first: dict[str, dict[int, tuple[int, dict[str, list[int]]]]] = field(default_factory=dict)
    #: request id -> the engine id of the in-memory P it loads from.
    peer_of: dict[str, str] = field(default_factory=dict)
    #: request id -> when it was added / first named in a report.
    added_at: dict[str, float] = field(default_factory=dict)
    reported_s: dict[str, float] = field(default_factory=dict)
    #: How many of the engine's ``kv_reports`` :meth:`ToyDriver.observe` has read.
    reports_read: int = 0


@dataclass(frozen=True)
class _ToyInjector(Injector):
    """A toy fault: ``kills_peer``, the in-memory P the requests come from dies once
    they were added (``add_remote_requests``), one event for all of them."""

    kills_peer: bool = False


@dataclass
class _ToyDelay:
    """A ``net_delay`` fault's state: D steps its load has been seen waiting."""

    steps: int = 0


@dataclass
class _ToyLateWrite:
    """A ``slow_peer_past_deadline`` load on the toy: what its late write will write."""

    #: rank -> the load as that rank's worker started it (its blocks, P's key).
    loads: dict[int, Any] = field(default_factory=dict)
    #: Counted from the step the load was first seen no longer waiting.
    gate: LateWriteGate = field(default_factory=LateWriteGate)
    #: What the late write did, once done.
    done: str | None = None


def make_driver(name: str) -> ToyDriver:
    """Entry point ``kvfail.drivers`` ``toy``."""
    return ToyDriver(name)
