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

import importlib
import importlib.metadata
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvfail.conformance.capabilities import Capabilities
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine

__all__ = [
    "ENTRY_POINT_GROUP",
    "Driver",
    "DriverUnavailable",
    "GenericDriver",
    "MooncakeDriver",
    "ToyDriver",
    "resolve",
]

ENTRY_POINT_GROUP = "kvfail.drivers"

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
        return Engine(spec)

    def arm(self, engine: Engine, request_id: str, point: FaultPoint) -> None:  # noqa: B027
        """Called before :meth:`add_remote_request` for a fault that must be set up before
        the request exists (e.g. a bad address in P's ``kv_transfer_params``); default: the
        fault is provoked later by :meth:`provoke`."""

    @abstractmethod
    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """Add a request to D whose prefix is to be loaded from the remote prefill."""

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


# ------------------------------------------------------------------------ toy


class ToyDriver(Driver):
    """In-process driver for ``ToyConnector`` and its subclasses (a TEST DOUBLE).

    Loads run in the toy's ``hold`` mode so the driver decides when each one ends; P is
    played by writing a seeded byte pattern into the toy's in-memory transport, so D's
    blocks can be compared with it afterwards.
    """

    #: The toy reporter's watchdog deadline used by the silent-peer scenario.
    DEADLINE_S = 0.5
    REMOTE_ENGINE = "P-toy"

    def __init__(self, name: str = "toy", connector_cls: type | None = None) -> None:
        from kvfail.harness.toy import ToyConnector

        self.name = name
        self.connector_cls = connector_cls or ToyConnector
        if not issubclass(self.connector_cls, ToyConnector):
            raise TypeError(f"{self.connector_cls.__name__} is not a ToyConnector")
        self._patterns: dict[tuple[int, str], dict[str, Any]] = {}
        self._blocks: dict[tuple[int, str], list[list[int]]] = {}

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.PEER_ERROR_RESPONSE,  # toy transport reports an error
                FaultPoint.FREEZE_PEER,  # toy transport never answers
                FaultPoint.ABORT_WHILE_WAITING,
                FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS,
                FaultPoint.TP_ONE_RANK,
            }
        )

    def declared(self) -> Declared:
        from kvfail.reporter import FailureReporterMixin

        cls = self.connector_cls.__name__
        deadline = issubclass(self.connector_cls, FailureReporterMixin)
        return {
            "async_load": (True, f"{cls} loads asynchronously (load_kv_async=True)"),
            "sync_load": (False, f"{cls} only advertises asynchronous loads"),
            "remote_prefill": (True, "the toy transport plays P in memory"),
            "two_groups": (True, "the harness builds D with two KV-cache groups"),
            "has_deadline": (
                deadline,
                f"toy_deadline_s={self.DEADLINE_S} (kvfail reporter watchdog)"
                if deadline
                else f"{cls} has no load deadline",
            ),
            "deadline_s": (self.DEADLINE_S if deadline else None, "toy_deadline_s"),
            "real_transport": (False, f"{cls} is an in-memory test double, not a transport"),
            "tp2": (True, "harness simulates TP=2; the toy's reporting is rank-independent"),
            "byte_verification": (True, "D's blocks are compared with P's seeded pattern"),
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

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        import torch

        from kvfail.harness.toy import TRANSPORT

        block_size = engine.spec.block_size
        num_blocks = max((prompt_len - 1) // block_size, 0)
        gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
        caches = engine.workers[0].kv_caches
        layers = {
            name: torch.randn((num_blocks, *cache.shape[1:]), generator=gen).to(cache.dtype)
            for name, cache in caches.items()
        }
        TRANSPORT.put((self.REMOTE_ENGINE, request_id), layers)
        self._patterns[(id(engine), request_id)] = layers
        engine.add_request(
            request_id,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            kv_transfer_params={
                "do_remote_prefill": True,
                "remote_engine_id": self.REMOTE_ENGINE,
                "remote_request_id": request_id,
            },
        )
        return request_id

    def _workers(self, engine: Engine, ranks: Iterable[int] | None) -> list[Any]:
        wanted = None if ranks is None else set(ranks)
        return [w for w in engine.workers if wanted is None or w.rank in wanted]

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        blocks = engine.scheduler.kv_cache_manager.get_block_ids(request_id)
        self._blocks[(id(engine), request_id)] = [list(g) for g in blocks]
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
        # FREEZE_PEER: the toy transport simply never answers; NOTIFY_ONLY_EMPTY_BLOCKS is
        # set up by the scenario (a request with no loadable block): nothing to do here.

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        layers = self._patterns.get((id(engine), request_id))
        blocks = self._blocks.get((id(engine), request_id))
        if layers is None or blocks is None:
            return f"no pattern or block ids recorded for {request_id}"
        groups = engine.kv_cache_config.kv_cache_groups
        group_of = {n: g for g, group in enumerate(groups) for n in group.layer_names}
        for worker in engine.workers:
            for name, expected in layers.items():
                ids = blocks[group_of[name]][: expected.shape[0]]
                got = worker.kv_caches[name][ids]
                if got.shape != expected.shape or not bool((got == expected).all()):
                    return f"rank {worker.rank} layer {name}: D's blocks {ids} differ from P's"
        return None

    def stop(self) -> None:
        from kvfail.harness.toy import TRANSPORT

        TRANSPORT.clear()
        self._patterns.clear()
        self._blocks.clear()


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
            "has_deadline": (False, why),
            "real_transport": (False, why),
            "tp2": (False, why),
            "byte_verification": (False, why),
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


class MooncakeDriver(Driver):
    """A real Mooncake P/D pair (``kvfail.peers.mooncake.MooncakePair``): P in its own OS
    process, each scenario's D a fresh ("cold") harness engine in this process.

    Faults are the ones that are honest on TCP loopback without restarting P (a P restart
    costs a vLLM import): a refused bootstrap address and an unknown engine id (active,
    applied to P's ``kv_transfer_params`` before D adds the request), a blackholed
    bootstrap proxy (silent), and the driver-side abort / empty-pull faults. D's bytes are
    checked against P's pattern by the pair's forward hook.

    ``connector``/``connector_module`` pick the connector on both sides: kvfail's
    (``connectors.mooncake``, ``--connector mooncake``) or upstream's
    (``--connector vllm:MooncakeConnector``).
    """

    poll_s = 0.005
    #: ``kvfail_deadline_s`` for kvfail's connector in the silent-peer scenario.
    SCENARIO_DEADLINE_S = 3.0
    #: Upstream D's socket timeout: P's abort timeout (set to 5 s here) + 60 s, hard-coded.
    UPSTREAM_DEADLINE_S = 65.0

    def __init__(
        self,
        name: str = "mooncake",
        *,
        connector: str = "KvfailMooncakeConnector",
        connector_module: str | None = "connectors.mooncake",
    ) -> None:
        self.name = name
        self._connector = connector
        self._module = connector_module
        self._why: str | None = None
        self._pair: Any = None
        self._names: dict[int, str] = {}
        self._fault_at_add: dict[tuple[int, str], FaultPoint] = {}
        self._proxy: Any = None
        self._seq = 0
        self.connector_cls = object
        try:
            if connector_module is None:
                from vllm.distributed.kv_transfer.kv_connector.factory import (
                    KVConnectorFactory,
                )

                self.connector_cls = KVConnectorFactory.get_connector_class_by_name(connector)
            else:
                self.connector_cls = getattr(importlib.import_module(connector_module), connector)
            from kvfail.peers.mooncake import mooncake_available

            self._why = mooncake_available()
        except Exception as exc:  # any import failure makes the driver unavailable
            self._why = f"{connector} / kvfail.peers.mooncake: {type(exc).__name__}: {exc}"

    @property
    def kvfail_connector(self) -> bool:
        return self._module is not None

    def unavailable(self) -> str | None:
        return self._why

    def start(self) -> None:
        if self._pair is not None:
            return
        from kvfail.peers.mooncake import MooncakePair

        self._pair = MooncakePair(
            policy="fail",
            connector=self._connector,
            connector_module=self._module,
            abort_request_timeout_s=5,
            ready_timeout_s=180.0,
        )

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy = None  # closed by the pair
        if self._pair is not None:
            self._pair.close()
            self._pair = None

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.REFUSE,
                FaultPoint.UNKNOWN_ENGINE,
                FaultPoint.NET_BLACKHOLE,
                FaultPoint.ABORT_WHILE_WAITING,
                FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS,
            }
        )

    def declared(self) -> Declared:
        deadline = self.SCENARIO_DEADLINE_S if self.kvfail_connector else self.UPSTREAM_DEADLINE_S
        return {
            "async_load": (True, "Mooncake pulls asynchronously"),
            "sync_load": (False, "Mooncake only advertises asynchronous loads"),
            "remote_prefill": (True, "a real P process prefills and serves the pull"),
            "two_groups": (False, "MooncakePair builds one-group D engines only"),
            "has_deadline": (
                True,
                f"kvfail_deadline_s={deadline:g}"
                if self.kvfail_connector
                else f"D socket timeout {deadline:g} s (abort timeout 5 s + 60 s upstream)",
            ),
            "deadline_s": (deadline, "driver"),
            "real_transport": (True, "Mooncake TransferEngine over TCP loopback"),
            "tp2": (
                False,
                "the harness runs both D ranks as TP rank 0, so the second Mooncake rank waits "
                "on P: not a real TP layout",
            ),
            "byte_verification": (True, "D's pulled blocks are compared with P's pattern"),
        }

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        raise NotImplementedError("MooncakeDriver builds engines through MooncakePair")

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
    ) -> Engine:
        if num_kv_cache_groups != 1 or tp_size != 1:
            raise NotImplementedError("MooncakePair builds one-group TP=1 D engines only")
        self.start()
        pair = self._pair
        self._seq += 1
        name = f"{policy}-{self._seq}"  # a fresh name: a cold D that never talked to P
        base = pair.extra_config
        if deadline and self.kvfail_connector:
            pair.extra_config = {**base, "kvfail_deadline_s": self.SCENARIO_DEADLINE_S}
        try:
            engine = pair.consumer(policy, name=name)
        finally:
            pair.extra_config = base
        self._names[id(engine)] = name
        return engine

    def arm(self, engine: Engine, request_id: str, point: FaultPoint) -> None:
        """Faults that live in P's ``kv_transfer_params`` must be set before D adds it."""
        self._fault_at_add[(id(engine), request_id)] = point

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        from kvfail.faults import ProxyMode
        from kvfail.peers.mooncake import refused_bootstrap, unknown_engine

        pair = self._pair
        params = pair.prefill(request_id, prompt_len)
        point = self._fault_at_add.pop((id(engine), request_id), None)
        if point is FaultPoint.REFUSE:
            params = refused_bootstrap(params)
        elif point is FaultPoint.UNKNOWN_ENGINE:
            params = unknown_engine(params)
        elif point is FaultPoint.NET_BLACKHOLE:
            if self._proxy is None:
                self._proxy = pair.bootstrap_proxy()
            self._proxy.set_mode(ProxyMode.BLACKHOLE)
            params = pair.via_proxy(params, self._proxy)
        pair.add(
            request_id,
            params,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            consumer=self._names[id(engine)],
        )
        return request_id

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        """Nothing to do: a real pull completes on its own."""

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

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        rec = self._pair.records.get(request_id)
        if rec is None or rec.verified is None:
            return f"{request_id} never ran after its load: no bytes were checked"
        return None if rec.verified else f"mismatched token positions {rec.mismatches}"


# ------------------------------------------------------------------------ resolve

BUILTIN: dict[str, Callable[[str], Driver]] = {
    "toy": lambda name: ToyDriver(name),
    "mooncake": lambda name: MooncakeDriver(name),
    # Upstream's connector, same real pair (not the generic driver): its deadline is real.
    "vllm:MooncakeConnector": lambda name: MooncakeDriver(
        name, connector="MooncakeConnector", connector_module=None
    ),
}


def _entry_point_drivers() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _import_class(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"expected module:Class, got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{path} is not a class")
    return obj


def _driver_for_class(name: str, cls: type, registry_name: str | None = None) -> Driver:
    from kvfail.harness.toy import ToyConnector

    if issubclass(cls, ToyConnector):
        return ToyDriver(name, cls)
    return GenericDriver(name, cls, registry_name)


def resolve(spec: str) -> Driver:
    """Turn a ``--connector`` value into a driver.

    ``toy`` | ``mooncake`` | a ``kvfail.drivers`` entry-point name | ``vllm:<RegistryName>``
    (vLLM's ``KVConnectorFactory`` registry) | ``module:Class``. Raises
    :class:`DriverUnavailable` when the name cannot be resolved to a class at all.
    """
    if spec in BUILTIN:
        return BUILTIN[spec](spec)
    entry_points = _entry_point_drivers()
    if spec in entry_points:
        factory = entry_points[spec].load()
        driver = factory(spec)
        if not isinstance(driver, Driver):
            raise TypeError(f"entry point {spec!r} returned {type(driver).__name__}, not Driver")
        return driver
    if spec.startswith("vllm:"):
        registry_name = spec.removeprefix("vllm:")
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        try:
            cls = KVConnectorFactory.get_connector_class_by_name(registry_name)
        except Exception as exc:
            raise DriverUnavailable(
                f"vLLM connector {registry_name!r} cannot be loaded ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls, registry_name)
    if ":" in spec:
        try:
            cls = _import_class(spec)
        except Exception as exc:
            raise DriverUnavailable(
                f"{spec} cannot be imported ({type(exc).__name__}: {exc})"
            ) from exc
        return _driver_for_class(spec, cls)
    known = sorted({*BUILTIN, *entry_points})
    raise DriverUnavailable(
        f"unknown connector {spec!r}: use one of {known}, vllm:<RegistryName> or module:Class"
    )
