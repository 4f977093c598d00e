"""The Driver API: how the suite builds, feeds and breaks one connector.

Why a driver and not just a connector class: the scenarios are the same for every
connector, but *how* to give a decode engine D a remote prefill to load, and how to make
that load fail at a named fault point (``kvfail.faults.points``), depends on the
transport. A driver answers exactly those questions and advertises which fault points it
can provoke; those, plus what is introspected from the connector class, are the
connector's :class:`~kvfail.conformance.capabilities.Capabilities`, and every scenario a
driver cannot serve is skipped *naming* the missing capability (csi-sanity's model: skips
are earned from what the driver advertises).

Drivers shipped here:

* ``toy``: :class:`ToyDriver` around :class:`kvfail.harness.toy.ToyConnector`, a labelled
  in-process TEST DOUBLE. It exists to test the suite itself fast; it proves nothing about
  a real transport. It also drives any ToyConnector subclass, which is how the negative
  controls (``kvfail.conformance.negative``) are run.
* ``mooncake``: :class:`MooncakeDriver`, adapting the real P/D pair in
  ``kvfail.peers.mooncake`` (P in its own OS process); unavailable, with the reason in
  every skip, until that module provides the API it needs.
* anything else (``vllm:<RegistryName>``, ``module:Class``) without a registered driver:
  :class:`GenericDriver`, which can build the engine but has no peer, so only the
  scenarios that need no remote prefill run.

Out-of-tree drivers register in the entry-point group ``kvfail.drivers``: the entry-point
name is the ``--connector`` value, and the loaded object is called with that value and
returns a :class:`Driver`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.conformance.capabilities import Capabilities
from kvfail.deadline import DEADLINE_KEY
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.hooks import SplitForward

__all__ = [
    "ENTRY_POINT_GROUP",
    "Driver",
    "DriverUnavailable",
    "GenericDriver",
    "MooncakeDriver",
    "PairDriver",
    "ToyDriver",
]

ENTRY_POINT_GROUP = "kvfail.drivers"

#: One P process per P configuration, shared by the drivers of a session that want the
#: same P (``mooncake`` and the real negative controls pull from kvfail's P; every NIXL
#: driver pulls from upstream's): each P costs a vLLM import (10-60 s here). A pair that
#: finds a live P here borrows it. The driver that started it owns it and closes it in
#: ``stop``, unless the driver hands it off (``PairDriver.hand_off_p``): then this registry
#: keeps it for the next driver and :func:`close_shared_producers` closes it at the end.
_SHARED_P: dict[str, Any] = {}


def shared_producer(key: str) -> Any | None:
    """The live P registered under ``key``, if any."""
    shared = _SHARED_P.get(key)
    if shared is None or not shared.process.alive:
        return None
    return shared


def register_producer(key: str, producer: Any) -> None:
    """Offer a P its starter owns to the drivers that want the same P (they borrow it)."""
    _SHARED_P[key] = producer


#: Registry keys whose P a stopped driver handed off, by that driver's class.
_HANDED_OFF: dict[str, type] = {}


def close_shared_producers(handed_off_by: type | None = None) -> None:
    """Close the registered P's (only those handed off by drivers of ``handed_off_by``
    when given: a P an idle registry keeps still costs CPU); idempotent."""
    keys = [
        k for k in list(_SHARED_P) if handed_off_by is None or _HANDED_OFF.get(k) is handed_off_by
    ]
    for key in keys:
        with contextlib.suppress(Exception):
            _SHARED_P[key].close()
        _SHARED_P.pop(key, None)
        _HANDED_OFF.pop(key, None)


Declared = dict[str, tuple[Any, str]]


class DriverUnavailable(Exception):
    """The driver cannot run here (module missing, peer cannot start); message = why."""


class Driver(ABC):
    """One connector under test, and the means to provoke its faults.

    Lifecycle: :meth:`start` once per session before the first scenario (start peers),
    :meth:`stop` at the end. Per scenario: :meth:`build_engine` (a fresh D), then
    :meth:`add_remote_request`, then :meth:`settle` or :meth:`provoke`.
    """

    #: The ``--connector`` value this driver was resolved from.
    name: str
    #: The connector class (the SCHEDULER and WORKER roles are both built from it).
    connector_cls: type
    #: Sleep between engine steps: a real transport progresses in its own threads.
    poll_s: float = 0.0
    #: ``slow_peer_past_deadline``: seconds after D added the load at which the slow P
    #: answers and writes; None: only once the load was reported (P never answers first).
    slow_peer_delay_s: float | None = None

    def unavailable(self) -> str | None:
        """None when the driver can run, else why not (printed in every skip)."""
        return None

    def start(self) -> None:  # noqa: B027 - optional hook, most drivers need no peers
        """Start peers (P processes, stores); idempotent."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop whatever :meth:`start` started; idempotent, bounded."""

    @property
    @abstractmethod
    def faults(self) -> frozenset[FaultPoint]:
        """The fault points this driver can provoke."""

    @abstractmethod
    def declared(self) -> Declared:
        """Capabilities introspection cannot see: name -> (value, evidence or reason)."""

    def capabilities(self) -> Capabilities:
        return Capabilities.build(
            self.connector_cls, driver=self.name, faults=self.faults, declared=self.declared()
        )

    @abstractmethod
    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        """The D engine's spec; ``deadline`` turns the connector's own load deadline on."""

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        from kvfail.harness.engine import Engine

        spec = self.engine_spec(
            policy, num_kv_cache_groups=num_kv_cache_groups, tp_size=tp_size, deadline=deadline
        )
        return Engine(spec, forward=self.forward())

    def forward(self) -> SplitForward | None:
        """D's forward (what runs where the model would), e.g. the integrity oracle's."""
        return None

    def arm(self, engine: Engine, request_id: str, point: FaultPoint) -> None:  # noqa: B027
        """Called before :meth:`add_remote_request` for a fault that must be set up before
        the request exists (e.g. a bad address in P's ``kv_transfer_params``); default: the
        fault is provoked later by :meth:`provoke`."""

    @abstractmethod
    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """Add a request to D whose prefix is to be loaded from the remote prefill."""

    def add_local_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """Add a request D computes itself (no remote prefill), watched by the driver's
        KV-integrity oracle where it has one: every position it computed must still hold
        D's bytes at each of its steps, so a stray write into the blocks it was given (a
        late transfer into reused blocks) is named. Default: added, not watched."""
        engine.add_request(
            request_id, prompt_len=prompt_len, prompt_seed=request_id, max_tokens=max_tokens
        )
        return request_id

    def add_remote_requests(
        self,
        engine: Engine,
        request_ids: Sequence[str],
        *,
        fault: FaultPoint | None = None,
        prompt_len: int = 100,
        max_tokens: int = 3,
        peer: int = 0,
    ) -> list[str]:
        """Add several remote-prefill requests from the same P, their loads to be in
        flight together, with ``fault`` armed for every one (then :meth:`provoke` each,
        as for one request).

        Why a method of its own: a fault on P itself (killed, stopped) is ONE event for
        all of them and must come after P prefilled every one; armed per request, the
        first would kill P and the rest would be prefilled by its replacement. Default:
        arm and add each in turn, right for a per-request fault; a driver overrides it
        for its faults on the whole peer.

        ``peer`` names the P they come from: 0 is the driver's P, 1 a second P (its own
        process, address and engine id), so one D can have loads in flight from two
        peers at once. Only a driver that advertises
        :attr:`~kvfail.faults.points.FaultPoint.KILL_ONE_PEER` has a second P; there,
        that fault kills the P named by ``peer`` once it prefilled these requests.
        """
        if peer != 0:
            raise NotImplementedError(f"driver {self.name!r} has one P: no peer {peer}")
        for request_id in request_ids:
            if fault is not None:
                self.arm(engine, request_id, fault)
            self.add_remote_request(
                engine, request_id, prompt_len=prompt_len, max_tokens=max_tokens
            )
        return list(request_ids)

    @abstractmethod
    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        """Let the request's load complete successfully (on ``ranks``; None: all)."""

    @abstractmethod
    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        """Make the request's in-flight load hit ``point`` (one of :attr:`faults`)."""

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        """After a successful load: None when D's blocks hold P's bytes, else the mismatch.

        Only called when the capabilities say ``byte_verification``.
        """
        raise NotImplementedError(f"driver {self.name!r} cannot verify bytes")

    def used_wrong_bytes(self, engine: Engine, request_id: str) -> str | None:
        """After any load: why D ran ``request_id`` on KV that is not P's, else None.

        Unlike :meth:`verify_bytes`, a request that was recomputed locally is fine: this is
        the oracle for a failure reported as success (the HF3FS pattern), which under
        ``recompute`` no policy-outcome check can see. Default: cannot tell (None).
        """
        return None

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        """Seconds from adding ``request_id`` to its first report, when the driver timed it."""
        return None

    def late_write(self, engine: Engine, request_id: str) -> str | None:
        """``slow_peer_past_deadline``: None until the slow P's late write for
        ``request_id`` has happened, then what it did (for the report). Only called for a
        load armed with that fault, by a driver that advertises it."""
        raise NotImplementedError(f"driver {self.name!r} has no slow peer")

    def integrity_findings(self, engine: Engine) -> list[str]:
        """The KV-integrity oracle's findings for everything ``engine`` ran (clause first;
        empty: every computed position held what it should, and nothing wrote into a
        released block). Default: this driver cannot see D's bytes."""
        return []

    def observe(self, engine: Engine) -> None:  # noqa: B027 - optional hook
        """Called after every step the suite takes on ``engine`` (timestamps reports)."""

    def end_faults(self, engine: Engine) -> None:  # noqa: B027 - optional hook
        """Let ``engine``'s peers finish what they owe it (thaw a frozen P): before the
        leak oracle, so blocks a connector holds while a peer may still write can come
        back. A dead peer stays dead."""

    def stuck_state(self, engine: Engine, request_ids: Iterable[str]) -> list[str]:
        """What the connector's workers hold for requests still waiting when the suite's
        wait ran out (handshakes, transfers and their states): evidence for a liveness
        finding, never a verdict. Empty when the driver cannot look."""
        return []

    def add_malformed_request(
        self, engine: Engine, request_id: str, kind: str, *, prompt_len: int = 100
    ) -> str:
        """Add a remote-prefill request whose ``kv_transfer_params`` are broken (``kind``)."""
        raise NotImplementedError(f"driver {self.name!r} cannot build malformed params")

    def after_scenario(self) -> None:  # noqa: B027 - optional hook
        """Called after every scenario's engines are closed: repair shared peers."""


# ------------------------------------------------------------------------ toy


class ToyDriver(Driver):
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
    :attr:`LATE_WRITE_STEPS` D steps after the load stopped waiting (its report reached
    the scheduler), the write lands (``ToyConnector.land_write``): P's bytes go into the
    blocks the load was given, in D's real KV tensors on every rank, wherever the
    scheduler has them by then: a slow P whose write lands after D gave up. Steps, not
    seconds, as for ``net_delay``.
    """

    #: The toy reporter's watchdog deadline used by the silent-peer scenario.
    DEADLINE_S = 0.5
    #: D steps a ``net_delay`` load waits before the in-memory P answers.
    DELAY_STEPS = 3
    #: D steps after a ``slow_peer_past_deadline`` load stopped waiting before the
    #: in-memory P's late write lands (requests added right after it got its blocks).
    LATE_WRITE_STEPS = 5
    REMOTE_ENGINE = "P-toy"

    def __init__(self, name: str = "toy", connector_cls: type | None = None) -> None:
        from kvfail.harness.toy import ToyConnector

        self.name = name
        self.connector_cls = connector_cls or ToyConnector
        if not issubclass(self.connector_cls, ToyConnector):
            raise TypeError(f"{self.connector_cls.__name__} is not a ToyConnector")
        #: (D engine id, request id) -> rank -> (tokens loaded, wrong positions) at the
        #: request's first schedule: the byte check of what it ran on.
        self._first: dict[tuple[str, str], dict[int, tuple[int, dict[str, list[int]]]]] = {}
        from kvfail.peers.integrity import IntegrityLedger

        #: The KV-integrity oracle; the in-memory P sends every rank the same bytes.
        self._integrity = IntegrityLedger(rank_seeded=False)
        #: (D engine id, request id) -> steps seen waiting, for ``net_delay`` loads.
        self._delayed: dict[tuple[str, str], int] = {}
        #: (D engine id, request id) -> the engine id of the P it loads from.
        self._peer_of: dict[tuple[str, str], str] = {}
        #: Engine ids of the in-memory P's killed in this scenario (``kill_one_peer``).
        self._dead_peers: set[str] = set()
        #: (D engine id, request id) -> when it was added / first named in a report.
        self._added_at: dict[tuple[str, str], float] = {}
        self._reported_s: dict[tuple[str, str], float] = {}
        #: D engine id -> how many of its ``kv_reports`` :meth:`observe` has read.
        self._reports_read: dict[str, int] = {}
        #: (D engine id, request id) -> a ``slow_peer_past_deadline`` load's late write.
        self._late: dict[tuple[str, str], _ToyLateWrite] = {}

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.PEER_ERROR_RESPONSE,  # toy transport reports an error
                FaultPoint.FREEZE_PEER,  # toy transport never answers
                FaultPoint.ABORT_WHILE_WAITING,
                FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS,
                FaultPoint.TP_ONE_RANK,
                FaultPoint.NET_DELAY,  # the in-memory P answers DELAY_STEPS steps late
                FaultPoint.KILL_ONE_PEER,  # a second in-memory P, whose loads all fail
                FaultPoint.SLOW_PEER_PAST_DEADLINE,  # writes once the load stopped waiting
            }
        )

    def declared(self) -> Declared:
        cls = self.connector_cls.__name__
        return {
            "async_load": (True, f"{cls} loads asynchronously (load_kv_async=True)"),
            "sync_load": (False, f"{cls} only advertises asynchronous loads"),
            "remote_prefill": (True, "the toy transport plays P in memory"),
            "two_groups": (True, "the harness builds D with two KV-cache groups"),
            "real_transport": (False, f"{cls} is an in-memory test double, not a transport"),
            "tp2": (True, "harness simulates TP=2; the toy's reporting is rank-independent"),
            "byte_verification": (True, "D's blocks are compared with P's seeded pattern"),
            "malformed_params": (False, f"{cls}'s in-memory transport has no params to break"),
        }

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
        self._first.setdefault((str(engine.spec.engine_id), req_id), {})[rank] = (loaded, wrong)

    @classmethod
    def remote_engine(cls, peer: int = 0) -> str:
        """The engine id of in-memory P number ``peer`` (0: the driver's P)."""
        return cls.REMOTE_ENGINE if peer == 0 else f"{cls.REMOTE_ENGINE}-{peer + 1}"

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        return self._add(engine, request_id, prompt_len, max_tokens, self.REMOTE_ENGINE)

    def add_remote_requests(
        self,
        engine: Engine,
        request_ids: Sequence[str],
        *,
        fault: FaultPoint | None = None,
        prompt_len: int = 100,
        max_tokens: int = 3,
        peer: int = 0,
    ) -> list[str]:
        """As the base, from in-memory P number ``peer``; ``kill_one_peer`` kills that P
        once it has "prefilled" them (its loads fail while in flight, see the class)."""
        if fault is not FaultPoint.KILL_ONE_PEER and peer == 0:
            return super().add_remote_requests(
                engine, request_ids, fault=fault, prompt_len=prompt_len, max_tokens=max_tokens
            )
        if fault not in (None, FaultPoint.KILL_ONE_PEER):
            raise ValueError(f"toy driver: {fault} is not armed on peer {peer}")
        remote = self.remote_engine(peer)
        for request_id in request_ids:
            self._add(engine, request_id, prompt_len, max_tokens, remote)
        if fault is FaultPoint.KILL_ONE_PEER:
            self._dead_peers.add(remote)
        return list(request_ids)

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
        self._added_at[(str(engine.spec.engine_id), request_id)] = time.monotonic()
        self._peer_of[(str(engine.spec.engine_id), request_id)] = remote
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

    def arm(self, engine: Engine, request_id: str, point: FaultPoint) -> None:
        """``net_delay`` and ``slow_peer_past_deadline`` are set up before the request
        exists; the rest are provoked."""
        if point is FaultPoint.NET_DELAY:
            self._delayed[(str(engine.spec.engine_id), request_id)] = 0
        elif point is FaultPoint.SLOW_PEER_PAST_DEADLINE:
            self._late[(str(engine.spec.engine_id), request_id)] = _ToyLateWrite()

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

    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        from kvfail import Stage

        if point not in self.faults:
            raise ValueError(f"toy driver cannot provoke {point}")
        if point in (FaultPoint.PEER_ERROR_RESPONSE, FaultPoint.TP_ONE_RANK):
            for worker in self._workers(engine, ranks):
                worker.connector.fail(
                    request_id,
                    stage=Stage.PEER,
                    reason=f"toy: provoked {point.value}",
                    block_index=block_index,
                )
        elif point is FaultPoint.ABORT_WHILE_WAITING:
            engine.abort(request_id)
        elif point is FaultPoint.KILL_ONE_PEER:
            self._fail_dead_peers(engine)
        # FREEZE_PEER: the toy transport simply never answers; NOTIFY_ONLY_EMPTY_BLOCKS is
        # set up by the scenario (a request with no loadable block); NET_DELAY answers by
        # itself (see observe): nothing to do here.

    def _fail_dead_peers(self, engine: Engine) -> None:
        """Fail, on every worker, each load in flight from a killed in-memory P (its
        death as the transport sees it: the peer is gone, not an answer from it)."""
        from kvfail import Stage

        if not self._dead_peers:
            return
        eid = str(engine.spec.engine_id)
        for worker in engine.workers:
            for req_id in sorted(worker.connector.inflight()):
                remote = self._peer_of.get((eid, req_id))
                if remote in self._dead_peers:
                    worker.connector.fail(
                        req_id, stage=Stage.PEER_LOST, reason=f"toy: P {remote} was killed"
                    )

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        first = self._first.get((str(engine.spec.engine_id), request_id))
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
        self._fail_dead_peers(engine)
        eid = str(engine.spec.engine_id)
        # Detection times: when a report first named each request (for detection_s).
        reports = engine.record.kv_reports
        now = time.monotonic()
        for report in reports[self._reports_read.get(eid, 0) :]:
            if report.rank is None:
                for rid in report.finished_recving | report.failed_recving:
                    self._reported_s.setdefault((eid, rid), now)
        self._reports_read[eid] = len(reports)
        waiting = engine.waiting_for_remote()
        for key in [k for k in self._late if k[0] == eid]:
            self._late_write_step(engine, key, waiting)
        # net_delay: the in-memory P answers once the load has waited DELAY_STEPS steps.
        for key in [k for k in self._delayed if k[0] == eid]:
            if key[1] not in waiting:
                if self._delayed[key]:  # it waited and ended otherwise (failed, aborted)
                    del self._delayed[key]
                continue
            self._delayed[key] += 1
            if self._delayed[key] >= self.DELAY_STEPS:
                del self._delayed[key]
                self.settle(engine, key[1])

    def _late_write_step(
        self, engine: Engine, key: tuple[str, str], waiting: frozenset[str]
    ) -> None:
        """``slow_peer_past_deadline``: note the load each worker started while it waits;
        :attr:`LATE_WRITE_STEPS` steps after it stopped waiting, write P's bytes into
        those blocks, on every rank (see the class docstring)."""
        late = self._late[key]
        rid = key[1]
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
        if late.left_at is None:
            late.left_at = engine.record.steps
        if engine.record.steps - late.left_at < self.LATE_WRITE_STEPS:
            return
        for worker in engine.workers:
            load = late.loads.get(worker.rank)
            if load is not None:
                worker.connector.land_write(rid, load)
        blocks = sorted({b for load in late.loads.values() for g in load.block_ids for b in g})
        late.done = (
            f"the toy's P wrote {rid}'s blocks {blocks} on ranks {sorted(late.loads)}, "
            f"{engine.record.steps - late.left_at} steps after the load stopped waiting"
        )

    def late_write(self, engine: Engine, request_id: str) -> str | None:
        late = self._late.get((str(engine.spec.engine_id), request_id))
        return None if late is None else late.done

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        key = (str(engine.spec.engine_id), request_id)
        if key not in self._reported_s or key not in self._added_at:
            return None
        return self._reported_s[key] - self._added_at[key]

    def integrity_findings(self, engine: Engine) -> list[str]:
        return self._integrity.final_findings(engine)

    def after_scenario(self) -> None:
        self._integrity.engines.clear()  # the scenario's engines are closed
        for timed in (self._delayed, self._added_at, self._reported_s, self._reports_read):
            timed.clear()
        self._late.clear()
        self._peer_of.clear()
        self._dead_peers.clear()  # the next scenario's second P is a new one

    def stop(self) -> None:
        from kvfail.harness.toy import TRANSPORT

        TRANSPORT.clear()
        self._first.clear()


@dataclass
class _ToyLateWrite:
    """A ``slow_peer_past_deadline`` load on the toy: what its late write will write."""

    #: rank -> the load as that rank's worker started it (its blocks, P's key).
    loads: dict[int, Any] = field(default_factory=dict)
    #: D's step count when the load was first seen no longer waiting.
    left_at: int | None = None
    #: What the late write did, once done.
    done: str | None = None


# ------------------------------------------------------------------------ generic


class GenericDriver(Driver):
    """A connector with no kvfail driver: it can be built, but there is no peer to load
    from, so only the scenarios needing no remote prefill run; the rest are skipped
    naming ``remote_prefill``."""

    def __init__(self, name: str, connector_cls: type, registry_name: str | None = None) -> None:
        self.name = name
        self.connector_cls = connector_cls
        self._registry_name = registry_name

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset()

    def declared(self) -> Declared:
        why = f"no kvfail driver for {self.name!r} (register one in {ENTRY_POINT_GROUP!r})"
        return {
            "async_load": (False, why),
            "sync_load": (False, why),
            "remote_prefill": (False, why),
            "two_groups": (False, why),
            "real_transport": (False, why),
            "tp2": (False, why),
            "byte_verification": (False, why),
            "malformed_params": (False, why),
        }

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        from kvfail.harness.config import EngineSpec

        if self._registry_name is not None:
            return EngineSpec(
                connector=self._registry_name,
                connector_module=None,
                policy=policy,
                num_kv_cache_groups=num_kv_cache_groups,
                tp_size=tp_size,
            )
        return EngineSpec(
            connector=self.connector_cls.__name__,
            connector_module=self.connector_cls.__module__,
            policy=policy,
            num_kv_cache_groups=num_kv_cache_groups,
            tp_size=tp_size,
        )

    #: Some connectors block forever while being built when a service they expect is
    #: absent (LMCache waits on its server); the suite must never hang on one.
    BUILD_TIMEOUT_S = 60.0

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        """Build in a helper thread, bounded; a connector that cannot be built here is
        :class:`DriverUnavailable` (a named skip, or a failure where drivers are required),
        not a contract failure."""
        import threading

        built: list[Engine] = []
        error: list[BaseException] = []

        def build() -> None:
            try:
                built.append(
                    super(GenericDriver, self).build_engine(
                        policy,
                        num_kv_cache_groups=num_kv_cache_groups,
                        tp_size=tp_size,
                        deadline=deadline,
                    )
                )
            except BaseException as exc:  # reported below, on the test's thread
                error.append(exc)

        worker = threading.Thread(target=build, name=f"kvfail-build-{self.name}", daemon=True)
        worker.start()
        worker.join(self.BUILD_TIMEOUT_S)
        if worker.is_alive():
            raise DriverUnavailable(
                f"{self.connector_cls.__name__} did not finish "
                f"construction within {self.BUILD_TIMEOUT_S:.0f} s in the generic harness "
                "(it blocks on a service that is absent here)"
            )
        if error:
            exc = error[0]
            raise DriverUnavailable(
                f"{self.connector_cls.__name__} cannot be constructed in "
                f"the generic harness ({type(exc).__name__}: {exc})"
            ) from exc
        return built[0]

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        raise NotImplementedError(self.declared()["remote_prefill"][1])

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        raise NotImplementedError(self.declared()["remote_prefill"][1])

    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        raise NotImplementedError(f"driver {self.name!r} provokes no fault")


# ------------------------------------------------------------------------ mooncake


class PairDriver(Driver):
    """What the drivers over a real P/D pair (:class:`MooncakeDriver`, ``NixlDriver``)
    share: connector resolution, cold D engines built through the pair, faults armed at
    add time, and the pair's records for bytes and detection times.

    A subclass sets ``pair_module`` (``kvfail.peers.<transport>``, whose
    ``<transport>_available`` says whether it can run), ``pair_name`` (for messages) and
    implements :meth:`start`, :meth:`_connector_bases` and :meth:`_consumer`.
    """

    poll_s = 0.005
    #: The deadline a deadline scenario asks D's connector for, through the configuration
    #: key kvfail's connectors read (:data:`kvfail.deadline.DEADLINE_KEY`); a connector that
    #: does not read it ignores it. The suite judges by what the connector declares.
    SCENARIO_DEADLINE_S = 3.0
    #: How late a slow but live P answers (``net_delay``): many D steps long, and far
    #: enough below :attr:`SCENARIO_DEADLINE_S` that a cold D's own set-up (bootstrap,
    #: first connection) on a loaded machine still fits before it.
    NET_DELAY_S = 0.5
    #: How long after :attr:`SCENARIO_DEADLINE_S` a ``slow_peer_past_deadline`` P answers
    #: and writes: well past a deadline enforced at D's drains (milliseconds apart), and
    #: well within the scenario's bounded waits.
    SLOW_PEER_PAST_S = 1.5
    #: At most this often a driver asks P whether its late write has landed.
    LATE_POLL_S = 0.25
    #: ``kvfail.peers.<transport>``: holds the pair and ``<transport>_available``.
    pair_module = ""
    #: The pair class's name, for messages.
    pair_name = ""
    #: Run the cyclic garbage collector once closed D engines are dropped: for a
    #: transport whose threads go only with the object (NIXL's agent polls a core until
    #: it is collected). Others leave the engines to reference counting (a collection
    #: costs ~0.85 s per scenario in a process holding vLLM).
    collect_closed_engines = False

    @property
    def slow_peer_delay_s(self) -> float:  # type: ignore[override]
        """``slow_peer_past_deadline``: P answers this long after D added the load."""
        return self.SCENARIO_DEADLINE_S + self.SLOW_PEER_PAST_S

    def _init_pair_driver(self, name: str, connector: str, connector_module: str | None) -> None:
        self.name = name
        self._connector = connector
        self._module = connector_module
        self._why: str | None = None
        self._pair: Any = None
        #: Pairs for the other layouts, by (tp_size, groups); ``_pair`` is TP 1, one group.
        self._layout_pairs: dict[tuple[int, int], Any] = {}
        #: Pairs whose P lost a rank on purpose: killed and replaced after the scenario.
        self._broken: set[int] = set()
        #: Which pair built each D engine (a driver may hold one pair per layout).
        self._engine_pairs: dict[int, Any] = {}
        self._names: dict[int, str] = {}
        self._seq = 0
        self.connector_cls: type = object
        try:
            if connector_module is None:
                from vllm.distributed.kv_transfer.kv_connector.factory import (
                    KVConnectorFactory,
                )

                self.connector_cls = KVConnectorFactory.get_connector_class_by_name(connector)
            else:
                self.connector_cls = getattr(importlib.import_module(connector_module), connector)
            peers = importlib.import_module(self.pair_module)
            transport = self.pair_module.rsplit(".", 1)[-1]
            self._why = getattr(peers, f"{transport}_available")()
        except Exception as exc:  # any import failure makes the driver unavailable
            self._why = f"{connector} / {self.pair_module}: {type(exc).__name__}: {exc}"

    @staticmethod
    def _connector_bases() -> tuple[type, type | None] | None:
        """(upstream connector, kvfail's connector or None); None without the transport."""
        raise NotImplementedError

    def unavailable(self) -> str | None:
        return self._why

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        raise NotImplementedError(f"{type(self).__name__} builds engines through {self.pair_name}")

    def _consumer(self, pair: Any, policy: Policy, name: str, deadline: bool) -> Engine:
        """A fresh D engine called ``name`` from ``pair``."""
        raise NotImplementedError

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        pair = self._layout_pair(tp_size, num_kv_cache_groups)
        self._seq += 1
        name = f"{policy}-{self._seq}"  # a fresh name: a cold D that never talked to P
        engine = self._consumer(pair, policy, name, deadline)
        self._names[id(engine)] = name
        self._engine_pairs[id(engine)] = pair
        return engine

    # ------------------------------------------------------------ pairs and their P

    #: The (tp_size, groups) layouts this driver's pairs can be built in.
    layouts: frozenset[tuple[int, int]] = frozenset({(1, 1)})
    #: At ``stop``, leave a healthy P to the session's registry for the next driver that
    #: wants the same P, instead of closing it (see ``_SHARED_P``).
    hand_off_p: bool = False

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int) -> Any:
        """A started pair whose P and D have this layout."""
        raise NotImplementedError

    def start(self) -> None:
        if self._pair is None:
            self._pair = self._new_pair(1, 1)

    def _layout_pair(self, tp_size: int, num_kv_cache_groups: int) -> Any:
        """The pair whose P matches this D layout (built on first use), with a live P."""
        layout = (tp_size, num_kv_cache_groups)
        if layout not in self.layouts:
            raise NotImplementedError(
                f"{self.pair_name} builds layouts {sorted(self.layouts)} only, not {layout}"
            )
        self.start()
        if layout == (1, 1):
            return self._live(self._pair)
        if layout not in self._layout_pairs:
            self._layout_pairs[layout] = self._new_pair(tp_size, num_kv_cache_groups)
        return self._live(self._layout_pairs[layout])

    def _pairs(self) -> list[Any]:
        return [p for p in (self._pair, *self._layout_pairs.values()) if p is not None]

    def stop(self) -> None:
        for pair in self._pairs():
            if self.hand_off_p:
                self._hand_off(pair)
            pair.close()
        self._pair = None
        self._layout_pairs.clear()

    def _hand_off(self, pair: Any) -> None:
        """Leave ``pair``'s own, healthy P to the session registry (see ``_SHARED_P``)
        instead of closing it, unless another live P already serves its key."""
        key = getattr(pair, "kvfail_share_key", None)
        producer = pair.p
        if key is None or producer is None or not pair.owns_p:
            return
        proc = producer.process
        if not proc.alive or proc.frozen or self._p_crashed(pair):
            return
        current = shared_producer(key)
        if current is not None and current is not producer:
            return
        _SHARED_P[key] = producer
        _HANDED_OFF[key] = type(self)
        pair.owns_p = False

    def _p_replaced(self, pair: Any) -> None:
        """Hook: ``pair`` gets a new P (forget what pointed at the old one)."""

    def _live(self, pair: Any) -> Any:
        """``pair`` with a live P (a P shared with another driver may have been killed
        by that driver's scenario: this driver then starts its own; the next use waits)."""
        if pair.p is None or not pair.p.process.alive:
            self._replace_p(pair)
        return pair

    def _replace_p(self, pair: Any, *, wait: bool = False) -> None:
        """Give ``pair`` a live P: the replacement another driver already registered for
        the same P (borrowed), else a new one of its own (registered for the others)."""
        self._p_replaced(pair)
        key = getattr(pair, "kvfail_share_key", None)
        shared = shared_producer(key) if key is not None else None
        if shared is not None and shared is not pair.p:
            pair.p, pair.owns_p = shared, False
            if wait:
                shared.wait_ready(pair.ready_timeout_s)
            return
        pair.restart_p(wait=wait)
        if key is not None:
            register_producer(key, pair.p)

    @staticmethod
    def _p_crashed(pair: Any) -> bool:
        """P's process lives but its engine crashed (a rank died), or it does not answer."""
        if pair.p is None or pair.p.ready is None:
            return False  # still starting: not known yet
        try:
            return pair.p.stats(timeout_s=10.0).get("crashed") is not None
        except Exception:
            return True

    def _forget_closed_engines(self) -> None:
        """Drop the pairs' references to D engines a scenario closed, and collect them.

        Why: a closed engine's transport can outlive its close (NIXL's agent, whose
        progress thread polls a core, goes only with the object), and every scenario
        builds a fresh D: 19 pollers had piled up in one NIXL session.
        """
        dropped = 0
        for pair in self._pairs():
            for name, engine in list(pair.decoders.items()):
                if engine.closed:
                    del pair.decoders[name]
                    dropped += 1
        if dropped and self.collect_closed_engines:
            gc.collect()

    def _repair_peers(self) -> None:
        """After a scenario: close a second P; thaw a frozen P; kill what is left of a P
        that lost a rank (on purpose, or a rank that died after a fault) so a driver
        sharing it sees it dead rather than half-working; replace a dead P without
        waiting for its import."""
        self._forget_closed_engines()
        for pair in self._pairs():
            pair.close_second_p()  # one scenario's (``kill_one_peer``); a later one starts anew
            if pair.p is None:
                continue
            proc = pair.p.process
            if proc.alive and proc.frozen:
                pair.thaw_p()
            if id(pair) in self._broken or (proc.alive and self._p_crashed(pair)):
                self._broken.discard(id(pair))
                pair.kill_p()
            if not proc.alive:
                self._replace_p(pair)

    def after_scenario(self) -> None:
        self._repair_peers()

    def stuck_state(self, engine: Engine, request_ids: Iterable[str]) -> list[str]:
        probe = getattr(self._pair_of(engine), "stuck_state", None)
        return [] if probe is None else list(probe(engine, list(request_ids)))

    def end_faults(self, engine: Engine) -> None:
        pair = self._pair_of(engine)
        producer = pair.p
        if producer is not None and producer.process.alive and producer.process.frozen:
            pair.thaw_p()

    def _pair_of(self, engine: Engine) -> Any:
        return self._engine_pairs.get(id(engine), self._pair)

    def _peer_producer(self, pair: Any, peer: int, fault: FaultPoint | None) -> Any:
        """P number ``peer`` of ``pair``, ready: 0 is its P, 1 its second P (started now
        if it has none). The second P serves plain loads, or is killed (``kill_one_peer``)."""
        if peer == 0:
            return pair._ready_producer()
        if peer != 1:
            raise ValueError(f"{self.pair_name} has two P's (peer 0 and 1), not peer {peer}")
        if fault not in (None, FaultPoint.KILL_ONE_PEER):
            raise ValueError(f"driver {self.name!r}: {fault} cannot be armed on the second P")
        return pair.second_p()

    def arm(self, engine: Engine, request_id: str, point: FaultPoint) -> None:
        """Every fault is set up while the request is added (see the class docstring)."""
        self._fault_at_add[(id(engine), request_id)] = point  # type: ignore[attr-defined]

    def add_local_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """A request D computes itself, watched by the pair's integrity oracle."""
        self._pair_of(engine).integrity.track(engine, request_id, request_id, prompt_len)
        return super().add_local_request(
            engine, request_id, prompt_len=prompt_len, max_tokens=max_tokens
        )

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        """Nothing to do: a real pull completes on its own."""

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        rec = self._pair_of(engine).records.get(request_id)
        if rec is None or rec.verified is None:
            return f"{request_id} never ran after its load: no bytes were checked"
        return None if rec.verified else f"mismatched token positions {rec.mismatches}"

    def used_wrong_bytes(self, engine: Engine, request_id: str) -> str | None:
        rec = self._pair_of(engine).records.get(request_id)
        if rec is None:
            return None
        # ``rank<r>`` with no positions: computed locally (recompute), nothing was used.
        wrong = {k: v for k, v in rec.mismatches.items() if ":" in k}
        if not wrong:
            return None
        return f"{request_id} ran on loaded KV that is not P's: positions {wrong}"

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        rec = self._pair_of(engine).records.get(request_id)
        return None if rec is None else rec.reported_s

    def integrity_findings(self, engine: Engine) -> list[str]:
        findings: list[str] = self._pair_of(engine).integrity_findings(engine)
        return findings


class MooncakeDriver(PairDriver):
    """A real Mooncake P/D pair (``kvfail.peers.mooncake.MooncakePair``): P in its own OS
    process, each scenario's D a fresh ("cold") harness engine in this process.

    Every fault is real, on TCP loopback, and provoked before D adds the request (a pull
    starts in D's first step, 0.15 s later, so nothing could be injected afterwards):

    * process faults on P: SIGKILL after P prefilled (``kill_before_pull``; D cold, or
      warm when the scenario pulled once first), SIGSTOP (``freeze_peer``, a silent P);
      SIGKILL one of two P processes D loads from at once (``kill_one_peer``: the pair's
      second P, a real process with its own bootstrap server, started for the scenario);
    * protocol faults answered by the real P process (``peer_error_response``,
      ``peer_err_reqs``, ``peer_finish_without_result``: see ``kvfail.peers.producer``);
    * network/params faults: a refused bootstrap address, an unknown engine id, a
      blackholed bootstrap proxy, malformed ``kv_transfer_params``;
    * a slow but live P (``net_delay``): P's sender sleeps :attr:`NET_DELAY_S` before it
      serves the pull for real, so the transfer and its reply come late (P-side, in the
      real process: a proxy in front of the bootstrap would delay only the lookup);
    * a slow P that writes after D's deadline (``slow_peer_past_deadline``): the same,
      for :attr:`slow_peer_delay_s` (the deadline the scenario asks D for, plus
      :attr:`SLOW_PEER_PAST_S`); P's own expiry is held off meanwhile, so P really
      pushes into D's blocks then, whatever D did (Mooncake is P-push: D has no handle
      on that write). :meth:`late_write` asks P whether each of its ranks pushed;
    * driver-side abort and empty pulls.

    P is shared across scenarios; after a scenario a frozen P is thawed and a killed one
    replaced (:meth:`after_scenario`, the new P's import overlapping the next D build).
    D's bytes are checked against P's pattern by the pair's forward hook.

    ``connector``/``connector_module`` pick D's connector: kvfail's (``connectors.mooncake``,
    ``--connector mooncake``), upstream's (``--connector vllm:MooncakeConnector``) or any
    ``MooncakeConnector`` subclass (``module:Class``, e.g. the negative controls). P runs
    ``p_connector``/``p_connector_module`` (default: the same as D).
    """

    pair_module = "kvfail.peers.mooncake"
    pair_name = "MooncakePair"
    layouts = frozenset({(1, 1), (2, 1), (1, 2), (2, 2)})
    #: The malformed ``kv_transfer_params`` this driver can build (see :meth:`malformed`).
    MALFORMED = ("missing_transfer_id", "bad_bootstrap_addr")
    #: Faults on P's whole process: one event for every request in flight from it.
    PEER_WIDE = frozenset(
        {FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER, FaultPoint.FREEZE_PEER}
    )

    def __init__(
        self,
        name: str = "mooncake",
        *,
        connector: str = "KvfailMooncakeConnector",
        connector_module: str | None = "connectors.mooncake",
        p_connector: str | None = None,
        p_connector_module: str | None = None,
    ) -> None:
        self._p_connector = p_connector
        self._p_module = p_connector_module
        self._seen: dict[int, int] = {}
        self._fault_at_add: dict[tuple[int, str], FaultPoint | str] = {}
        #: (D engine, request id) -> the P armed to write late (``slow_peer_past_deadline``).
        self._late: dict[tuple[int, str], Any] = {}
        #: (D engine, request id) -> what its late write did, once P says it happened.
        self._late_done: dict[tuple[int, str], str] = {}
        self._late_polled = 0.0
        #: Bootstrap proxies by pair (``id``), made on first use, closed by the pair.
        self._proxies: dict[int, Any] = {}
        self._init_pair_driver(name, connector, connector_module)

    @staticmethod
    def _connector_bases() -> tuple[type, type | None] | None:
        return mooncake_bases()

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int) -> Any:
        """A pair whose P has this layout; P is shared by the drivers of a session that
        want the same P connector and layout."""
        from kvfail.peers.mooncake import MooncakePair

        if self._p_connector is not None:
            p_side: list[Any] = [self._p_connector, self._p_module]
        else:  # P runs D's connector (as MooncakePair decides)
            p_side = [self._connector, self._module]
        key = json.dumps([*p_side, tp_size, num_kv_cache_groups])
        shared = shared_producer(key)
        pair = MooncakePair(
            policy="fail",
            connector=self._connector,
            connector_module=self._module,
            p_connector=self._p_connector,
            p_connector_module=self._p_module,
            tp_size=tp_size,
            num_kv_cache_groups=num_kv_cache_groups,
            abort_request_timeout_s=5,
            ready_timeout_s=180.0,
            producer=shared,
        )
        if shared is None:
            register_producer(key, pair.p)
        return pair

    def _p_replaced(self, pair: Any) -> None:
        self._proxies.pop(id(pair), None)  # the proxy fronted the old P's bootstrap port

    def stop(self) -> None:
        self._proxies.clear()  # closed by their pairs
        super().stop()

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.PEER_ERROR_RESPONSE,
                FaultPoint.PEER_ERR_REQS,
                FaultPoint.PEER_FINISH_WITHOUT_RESULT,
                FaultPoint.KILL_BEFORE_PULL,
                FaultPoint.KILL_DURING_TRANSFER,
                FaultPoint.KILL_ONE_PEER,
                FaultPoint.FREEZE_PEER,
                FaultPoint.REFUSE,
                FaultPoint.UNKNOWN_ENGINE,
                FaultPoint.NET_BLACKHOLE,
                FaultPoint.NET_DELAY,
                FaultPoint.SLOW_PEER_PAST_DEADLINE,
                FaultPoint.ABORT_WHILE_WAITING,
                FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS,
                FaultPoint.TP_ONE_RANK,
            }
        )

    def declared(self) -> Declared:
        return {
            "async_load": (True, "Mooncake pulls asynchronously"),
            "sync_load": (False, "Mooncake only advertises asynchronous loads"),
            "remote_prefill": (True, "a real P process prefills and serves the pull"),
            "two_groups": (
                True,
                "P and D both built with two KV-cache groups (MooncakeConnector is SupportsHMA)",
            ),
            "real_transport": (True, "Mooncake TransferEngine over TCP loopback"),
            "tp2": (
                True,
                "P and D each run two TP rank processes in a real gloo world (tp_mode=processes)",
            ),
            "byte_verification": (True, "D's pulled blocks are compared with P's pattern"),
            "malformed_params": (
                True,
                "P's real params, one field broken: " + ", ".join(self.MALFORMED),
            ),
        }

    def _consumer(self, pair: Any, policy: Policy, name: str, deadline: bool) -> Engine:
        base = pair.extra_config
        if deadline:
            pair.extra_config = {**base, DEADLINE_KEY: self.SCENARIO_DEADLINE_S}
        try:
            engine = pair.consumer(policy, name=name)
        finally:
            pair.extra_config = base
        self._seen[id(engine)] = 0
        return engine

    def observe(self, engine: Engine) -> None:
        if id(engine) in self._seen:
            pair = self._pair_of(engine)
            self._seen[id(engine)] = pair.observe(engine, self._seen[id(engine)])

    @staticmethod
    def malformed(params: dict[str, Any], kind: str) -> dict[str, Any]:
        """P's real ``kv_transfer_params`` with one field broken."""
        out = dict(params)
        if kind == "missing_transfer_id":
            out.pop("transfer_id", None)
        elif kind == "bad_bootstrap_addr":
            out["remote_bootstrap_addr"] = "127.0.0.1:not-a-port"
        else:
            raise ValueError(f"unknown malformation {kind!r}")
        return out

    def add_malformed_request(
        self, engine: Engine, request_id: str, kind: str, *, prompt_len: int = 100
    ) -> str:
        """Add a request whose params P produced but one field is broken (``MALFORMED``)."""
        self._fault_at_add[(id(engine), request_id)] = kind
        return self.add_remote_request(engine, request_id, prompt_len=prompt_len)

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        from kvfail.faults import ProxyMode
        from kvfail.peers.mooncake import refused_bootstrap, unknown_engine

        pair = self._live(self._pair_of(engine))
        params = pair.prefill(request_id, prompt_len)
        point = self._fault_at_add.pop((id(engine), request_id), None)
        if isinstance(point, str) and not isinstance(point, FaultPoint):
            params = self.malformed(params, point)
        elif point is FaultPoint.REFUSE:
            params = refused_bootstrap(params)
        elif point is FaultPoint.UNKNOWN_ENGINE:
            params = unknown_engine(params)
        elif point is FaultPoint.NET_BLACKHOLE:
            proxy = self._proxies.get(id(pair))
            if proxy is None:
                proxy = self._proxies[id(pair)] = pair.bootstrap_proxy()
            proxy.set_mode(ProxyMode.BLACKHOLE)
            params = pair.via_proxy(params, proxy)
        elif point is FaultPoint.PEER_ERROR_RESPONSE:
            pair.inject(request_id, "error_response")
        elif point is FaultPoint.PEER_ERR_REQS:
            pair.inject(request_id, "err_reqs")
        elif point is FaultPoint.PEER_FINISH_WITHOUT_RESULT:
            pair.inject(request_id, "finish_without_result")
        elif point is FaultPoint.NET_DELAY:
            pair.inject(request_id, "delay", delay_s=self.NET_DELAY_S)
        elif point is FaultPoint.SLOW_PEER_PAST_DEADLINE:
            pair.inject(request_id, "delay", delay_s=self.slow_peer_delay_s)
            self._late[(id(engine), request_id)] = pair.p
        elif point in (FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER):
            pair.kill_p()  # one request: its P is the one that dies
        elif point is FaultPoint.KILL_DURING_TRANSFER:
            # P's sender really writes half of the pull into D, then SIGKILLs itself.
            pair.inject(request_id, "die_mid_transfer")
            self._broken.add(id(pair))
        elif point is FaultPoint.TP_ONE_RANK:
            # A real one-rank crash: P's TP rank 1 is SIGKILLed, rank 0 serves its pull.
            # (Rank 1: P's rank 0 also hosts Mooncake's bootstrap server, so killing it
            # would fail every rank's query, not one rank's transfer.)
            pair.signal_p_rank(1, signal.SIGKILL)
            self._broken.add(id(pair))
        elif point is FaultPoint.FREEZE_PEER:
            pair.freeze_p()
        pair.add(
            request_id,
            params,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            consumer=self._names[id(engine)],
        )
        return request_id

    def add_remote_requests(
        self,
        engine: Engine,
        request_ids: Sequence[str],
        *,
        fault: FaultPoint | None = None,
        prompt_len: int = 100,
        max_tokens: int = 3,
        peer: int = 0,
    ) -> list[str]:
        """P (``peer`` 1: the pair's second P) prefills every request, then a fault on
        that P itself (SIGKILL, SIGSTOP) happens once, then D adds them all; other faults
        are armed per request (see the base), on the driver's P only."""
        if peer == 0 and fault not in self.PEER_WIDE:
            return super().add_remote_requests(
                engine, request_ids, fault=fault, prompt_len=prompt_len, max_tokens=max_tokens
            )
        pair = self._live(self._pair_of(engine))
        producer = self._peer_producer(pair, peer, fault)
        params = {rid: producer.prefill(rid, prompt_len, rid) for rid in request_ids}
        if fault in (FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER):
            if peer == 0:
                pair.kill_p()
            else:
                pair.kill_second_p()
        elif fault is FaultPoint.FREEZE_PEER:
            pair.freeze_p()
        for rid, rid_params in params.items():
            pair.add(
                rid,
                rid_params,
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                consumer=self._names[id(engine)],
            )
        return list(request_ids)

    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        if point is FaultPoint.ABORT_WHILE_WAITING:
            engine.abort(request_id)
        # The others were armed before the request was added (see arm()).

    def late_write(self, engine: Engine, request_id: str) -> str | None:
        """Whether P's delayed push for ``request_id`` ran on every P rank (asked of P
        at most every :attr:`LATE_POLL_S`); then which ranks' push wrote into D."""
        key = (id(engine), request_id)
        if key in self._late_done:
            return self._late_done[key]
        producer = self._late.get(key)
        now = time.monotonic()
        if producer is None or now - self._late_polled < self.LATE_POLL_S:
            return None
        self._late_polled = now
        if not producer.process.alive or producer.process.frozen:
            return None
        try:
            pushes = producer.late_pushes()
        except Exception:  # P busy or gone: asked again at the next poll, within the bound
            return None
        pushed = pushes["pushed"].get(request_id, [])
        if len(pushed) < len(engine.workers):
            return None
        written = pushes["written"].get(request_id, [])
        self._late_done[key] = (
            f"P pushed {request_id} {self.slow_peer_delay_s:g} s after the pull; the push "
            f"wrote into D on rank(s) {written} of {sorted(pushed)}"
        )
        return self._late_done[key]

    def after_scenario(self) -> None:
        self._late.clear()
        self._late_done.clear()
        super().after_scenario()


def mooncake_bases() -> tuple[type, type | None] | None:
    """(upstream ``MooncakeConnector``, kvfail's connector or None), None without Mooncake."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeConnector,
        )
    except Exception:
        return None
    try:
        from connectors.mooncake import KvfailMooncakeConnector
    except Exception:
        return MooncakeConnector, None
    return MooncakeConnector, KvfailMooncakeConnector
