"""The Driver API: how the suite builds, feeds and breaks one connector.

Why a driver and not just a connector class: the scenarios are the same for every
connector, but *how* to give a decode engine D a remote prefill to load, and how to make
that load fail at a named fault point (``kvfail.faults.points``), depends on the
transport. A driver answers exactly those questions. Its fault table
(:attr:`Driver.injectors`: fault point -> :class:`Injector`) says which fault points it can
provoke and how; its :class:`Declared` says what introspection cannot see; the optional
abilities it implements (:class:`ByteOracle`, :class:`LateWrites`, :class:`MalformedParams`,
in :mod:`kvfail.conformance.abilities`) are read from its class. Those, plus what is
introspected from the connector class, are the connector's
:class:`~kvfail.conformance.capabilities.Capabilities`, and every scenario a driver cannot
serve is skipped *naming* the missing capability (csi-sanity's model: skips are earned
from what the driver advertises).

This module is the API only: it imports no driver. Each in-tree driver has its own module
(``toy_driver``, ``generic_driver``, ``pair_driver`` with ``mooncake_driver`` and
``nixl_driver`` on it, ``nixl_push_driver``, ``store_driver``
(vLLM's ExampleConnector, and the base of the other store drivers)), and every one a
``--connector`` name reaches is registered in the entry-point group ``kvfail.drivers``,
the same group an out-of-tree driver uses: the entry-point name is the ``--connector``
value, and the loaded object is called with that value and returns a :class:`Driver`
(``docs/driver-guide.md`` walks through writing one).
"""

from __future__ import annotations

import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from kvfail.conformance.abilities import (
    LATE_WRITE_STEPS,
    POINT_NEEDS,
    ByteOracle,
    LateWriteGate,
    LateWrites,
    MalformedParams,
    abilities,
)
from kvfail.conformance.capabilities import Capabilities, Claim, Declared
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.hooks import SplitForward

__all__ = [
    "ABORT",
    "ENTRY_POINT_GROUP",
    "LATE_WRITE_STEPS",
    "REQUIRED_MEMBERS",
    "ByteOracle",
    "Claim",
    "Declared",
    "Driver",
    "DriverUnavailable",
    "EngineHandle",
    "Fault",
    "Injector",
    "LateWriteGate",
    "LateWrites",
    "MalformedParams",
    "Provocation",
    "RemoteBatch",
    "abilities",
    "abort_request",
    "declared_capabilities",
]

ENTRY_POINT_GROUP = "kvfail.drivers"


@dataclass(eq=False)
class Fault:
    """One fault armed for one request on one D engine, from arming to provoking.

    :meth:`Driver.arm` makes it and files it on the engine's :class:`EngineHandle`;
    the driver's :meth:`Driver.add_remote_request` takes it from there
    (:meth:`Driver.take_fault`) to set up what must exist before D adds the request,
    and keeps in :attr:`state` whatever it will need later (a frozen P, a late write, a
    step count), so :meth:`Driver.provoke` and the driver's per-step hooks find
    everything about this fault in this one object.
    """

    point: FaultPoint
    request_id: str
    #: The driver's own record of what it did for this fault (None: nothing yet).
    state: Any = None
    #: The TP ranks a fault on one rank hits (None: the fault names no rank).
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Provocation:
    """One call of :meth:`Driver.provoke`, as an injector's ``provoke`` hook gets it."""

    engine: Engine
    request_id: str
    point: FaultPoint
    #: The D ranks to hit (None: all), for a fault on one rank.
    ranks: Iterable[int] | None = None
    #: The block to fail (None: the driver's choice), for a fault on one block.
    block_index: int | None = None


@dataclass(frozen=True)
class RemoteBatch:
    """One :meth:`Driver.add_remote_requests` call, as its hooks get it: requests D loads
    together from one P, with the fault armed for them."""

    engine: Engine
    request_ids: tuple[str, ...]
    fault: FaultPoint | None = None
    prompt_len: int = 100
    max_tokens: int = 3
    #: 0: the driver's P; 1: its second P.
    peer: int = 0
    #: The TP ranks a fault on one rank hits (None: the fault names no rank).
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Injector:
    """How one driver makes one fault point happen: the hooks the scenario's calls reach.

    A driver's :attr:`Driver.injectors` maps every fault point it can provoke to one, and
    the driver's fault list is that table's keys, so what a driver advertises and what it
    does are one table. ``state`` makes the :class:`Fault`'s first state when the driver
    takes the armed fault (:meth:`Driver.take_fault`); ``provoke`` runs in
    :meth:`Driver.provoke` (None: nothing left to do then: the fault was set up when the
    request was added, or happens by itself). ``not_alone`` declares the TP ranks a
    one-rank fault cannot hit without hitting others. A driver family whose set-up needs more
    hooks (P's params, P's whole process) subclasses this with them, and its own
    ``add_remote_request`` calls them.
    """

    provoke: Callable[[Provocation], None] | None = None
    state: Callable[[], Any] | None = None
    #: For a fault on one TP rank: the ranks it cannot hit alone here, each with why
    #: (killing a process that also serves the other ranks fails them too). The suite
    #: reads it (``Capabilities.rank_limits``) and faults such a rank another way, or
    #: skips it naming this reason.
    not_alone: Mapping[int, str] = field(default_factory=dict)


def abort_request(call: Provocation) -> None:
    """``abort_while_waiting``: abort the request on D, wherever its load is."""
    call.engine.abort(call.request_id)


#: The injector of ``abort_while_waiting``, the same for every driver.
ABORT = Injector(provoke=abort_request)


@dataclass(eq=False)
class EngineHandle:
    """What a driver keeps about one D engine: one object per engine, never a dict keyed
    by ``id(engine)`` (an id is reused once the engine is collected).

    :meth:`Driver.handle` makes it on first use; the suite drops every handle once the
    scenario's engines are closed. A driver that keeps more per engine subclasses it and
    overrides :meth:`Driver.new_handle`.
    """

    engine: Engine
    #: Faults armed on this engine, by request id, until the driver takes or ends them.
    faults: dict[str, Fault] = field(default_factory=dict)
    #: Faults the driver set up and still has to act on (provoke, a per-step hook).
    active: dict[str, Fault] = field(default_factory=dict)

    def take_fault(self, request_id: str) -> Fault | None:
        """The fault armed for ``request_id`` (None: none), moved to :attr:`active`."""
        fault = self.faults.pop(request_id, None)
        if fault is not None:
            self.active[request_id] = fault
        return fault


class DriverUnavailable(Exception):
    """The driver cannot run here (module missing, peer cannot start); message = why."""


#: The handle type a driver keeps per D engine (see :meth:`Driver.new_handle`).
H = TypeVar("H", bound=EngineHandle)

#: Optional members renamed to say they return a finding (a reason, or None), not a yes/no:
#: a driver written against the old name is served under the new one, so its oracle is not
#: silently left at the default.
RENAMED = {"used_wrong_bytes": "wrong_bytes_finding", "late_write": "late_write_finding"}

#: What every driver must define; everything else on :class:`Driver` has a default.
REQUIRED_MEMBERS = (
    "name",
    "connector_cls",
    "declared",
    "injectors",
    "engine_spec",
    "add_remote_request",
)


class Driver(ABC, Generic[H]):
    """One connector under test, and the means to provoke its faults.

    Required (:data:`REQUIRED_MEMBERS`): :attr:`name`, :attr:`connector_cls`,
    :meth:`declared`, :attr:`injectors`, :meth:`engine_spec`, :meth:`add_remote_request`.
    Optional abilities are protocols a driver implements (:class:`ByteOracle`,
    :class:`LateWrites`, :class:`MalformedParams`); every other member has a default.

    Lifecycle: :meth:`start` once per session before the first scenario (start peers),
    :meth:`stop` at the end. Per scenario: :meth:`build_engine` (a fresh D), then
    :meth:`add_remote_request`, then :meth:`settle` or :meth:`provoke`; once judged,
    :meth:`before_close`, then the suite closes the engines, drops their handles and
    calls :meth:`after_scenario`.
    """

    #: The ``--connector`` value this driver was resolved from.
    name: str
    #: The connector class (the SCHEDULER and WORKER roles are both built from it).
    connector_cls: type
    #: Sleep between engine steps: a real transport progresses in its own threads.
    poll_s: float = 0.0
    #: Why :func:`kvfail.conformance.resolve.resolve` chose this driver (the run's header
    #: prints it). A driver that claims classes has a classmethod ``claims(probe)``
    #: (:mod:`kvfail.conformance.claims`).
    chosen: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in RENAMED.items():
            if old in vars(cls) and new not in vars(cls):
                warnings.warn(
                    f"{cls.__qualname__}.{old} is deprecated: name it {new}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                setattr(cls, new, vars(cls)[old])
        if "faults" in vars(cls) and getattr(cls.injectors, "__isabstractmethod__", False):
            # A driver written before the fault table: its own ``provoke`` still acts,
            # and its table is its list, each point with an injector that does nothing.
            warnings.warn(
                f"{cls.__qualname__}.faults is deprecated: map each fault point to an "
                "Injector in injectors (the fault list is derived from it)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.injectors = property(  # type: ignore[assignment]
                lambda self: {point: Injector() for point in self.faults}
            )

    def unavailable(self) -> str | None:
        """None when the driver can run, else why not (printed in every skip)."""
        return None

    def start(self) -> None:
        """Start peers (P processes, stores); idempotent."""

    def stop(self) -> None:
        """Stop whatever :meth:`start` started; idempotent, bounded."""

    # ------------------------------------------------------------ what it can do

    @property
    @abstractmethod
    def injectors(self) -> Mapping[FaultPoint, Injector]:
        """The fault table: every fault point this driver can provoke, and how."""

    @property
    def faults(self) -> frozenset[FaultPoint]:
        """The fault points this driver can provoke: its table's keys."""
        return frozenset(self.injectors)

    @abstractmethod
    def declared(self) -> Declared:
        """Capabilities introspection cannot see, each with its evidence or reason."""

    def capabilities(self) -> Capabilities:
        return Capabilities.build(
            self.connector_cls,
            driver=self.name,
            faults=self.faults,
            declared=declared_capabilities(self),
            rank_limits={
                point: injector.not_alone
                for point, injector in self.injectors.items()
                if injector.not_alone
            },
        )

    # ------------------------------------------------------------ D

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

    def new_handle(self, engine: Engine) -> H:
        """A new handle for ``engine``: a driver that keeps more per engine is a
        ``Driver[MyHandle]`` and returns a ``MyHandle`` here."""
        return cast(H, EngineHandle(engine))

    def handle(self, engine: Engine) -> H:
        """This driver's one handle for ``engine``, made on first use."""
        handles: weakref.WeakKeyDictionary[Engine, H] | None = getattr(self, "_handles", None)
        if handles is None:
            handles = self._handles = weakref.WeakKeyDictionary()
        found = handles.get(engine)
        if found is None:
            found = handles[engine] = self.new_handle(engine)
        return found

    def forget_engines(self) -> None:
        """Drop every engine's handle. The suite calls it after each scenario, before
        :meth:`after_scenario` (a handle holds its engine, and a closed engine's
        transport may live until the engine is collected); idempotent."""
        handles = getattr(self, "_handles", None)
        if handles is not None:
            handles.clear()

    def handles(self) -> list[EngineHandle]:
        """The handles of the engines this driver has seen and that still exist."""
        handles = getattr(self, "_handles", None)
        return [] if handles is None else list(handles.values())

    # ------------------------------------------------------------ loads and faults

    def arm(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
    ) -> Fault:
        """Arm ``point`` for the request about to be added as ``request_id``: call before
        :meth:`add_remote_request`, which sets up whatever must exist before the request
        does (e.g. a bad address in P's ``kv_transfer_params``); the rest happens in
        :meth:`provoke`. ``ranks``: the TP ranks a fault on one rank hits (a driver that
        acts before D adds the request reads them here; :meth:`provoke` gets them again).
        Returns the :class:`Fault`, filed on the engine's handle."""
        fault = Fault(point, request_id, ranks=None if ranks is None else tuple(ranks))
        self.handle(engine).faults[request_id] = fault
        return fault

    def take_fault(self, engine: Engine, request_id: str) -> tuple[Fault, Injector] | None:
        """The fault armed for ``request_id`` and its injector (None: none armed), the
        fault now active, its state made by the injector's ``state``."""
        fault = self.handle(engine).take_fault(request_id)
        if fault is None:
            return None
        injector = self.injector(fault.point)
        if injector.state is not None:
            fault.state = injector.state()
        return fault, injector

    def injector(self, point: FaultPoint) -> Injector:
        """``point``'s injector; a ``ValueError`` for a point this driver cannot provoke."""
        found = self.injectors.get(point)
        if found is None:
            raise ValueError(f"driver {self.name!r} cannot provoke {point.value}")
        return found

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
        ranks: Iterable[int] | None = None,
    ) -> list[str]:
        """Add several remote-prefill requests from the same P, their loads to be in
        flight together, with ``fault`` armed for every one (then :meth:`provoke` each,
        as for one request; ``ranks`` as for :meth:`arm`).

        Why a method of its own: a fault on P itself (killed, stopped) is ONE event for
        all of them and must come after P prefilled every one; armed per request, the
        first would kill P and the rest would be prefilled by its replacement. So a fault
        :meth:`hits_whole_peer` says is on P goes to :meth:`add_from_peer`, once for the
        batch; any other is armed per request by :meth:`add_each`. A driver overrides
        those hooks, not this dispatch.

        ``peer`` names the P they come from: 0 is the driver's P, 1 a second P (its own
        process, address and engine id), so one D can have loads in flight from two
        peers at once. Only a driver that advertises
        :attr:`~kvfail.faults.points.FaultPoint.KILL_ONE_PEER` has a second P; there,
        that fault kills the P named by ``peer`` once it prefilled these requests.
        """
        batch = RemoteBatch(
            engine,
            tuple(request_ids),
            fault=fault,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            peer=peer,
            ranks=None if ranks is None else tuple(ranks),
        )
        if peer == 0 and not self.hits_whole_peer(fault):
            self.add_each(batch)
        else:
            self.add_from_peer(batch)
        return list(batch.request_ids)

    def hits_whole_peer(self, fault: FaultPoint | None) -> bool:
        """Whether ``fault`` hits P's whole process (one event for a batch, in
        :meth:`add_from_peer`) rather than each request. Default: none does."""
        return False

    def add_each(self, batch: RemoteBatch) -> None:
        """Arm the batch's fault for each request and add it: right for a per-request
        fault. Default: one :meth:`add_remote_request` per request; a driver whose P
        prefills several requests at once does it here for the whole batch."""
        for request_id in batch.request_ids:
            if batch.fault is not None:
                self.arm(batch.engine, request_id, batch.fault, ranks=batch.ranks)
            self.add_remote_request(
                batch.engine,
                request_id,
                prompt_len=batch.prompt_len,
                max_tokens=batch.max_tokens,
            )

    def add_from_peer(self, batch: RemoteBatch) -> None:
        """Add the batch from P number ``batch.peer``, its fault (one :meth:`hits_whole_peer`
        says is on P) happening once for all. Default: the driver has one P and no such
        fault."""
        raise NotImplementedError(f"driver {self.name!r} has one P: no peer {batch.peer}")

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        """Let the request's load complete successfully (on ``ranks``; None: all).
        Default: nothing to do, a real transport completes a good load by itself."""

    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        """Make the request's in-flight load hit ``point``: its injector's ``provoke``."""
        hook = self.injector(point).provoke
        if hook is not None:
            hook(Provocation(engine, request_id, point, ranks, block_index))

    # ------------------------------------------------------------ evidence and repair

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        """Seconds from adding ``request_id`` to its first report, when the driver timed it."""
        return None

    def integrity_findings(self, engine: Engine) -> list[str]:
        """The KV-integrity oracle's findings for everything ``engine`` ran (clause first;
        empty: every computed position held what it should, and nothing wrote into a
        released block). Default: this driver cannot see D's bytes."""
        return []

    def observe(self, engine: Engine) -> None:
        """Called after every step the suite takes on ``engine`` (timestamps reports)."""

    def end_faults(self, engine: Engine) -> None:
        """Let ``engine``'s peers finish what they owe it (thaw a frozen P): before the
        leak oracle, so blocks a connector holds while a peer may still write can come
        back. A dead peer stays dead."""

    def stuck_state(self, engine: Engine, request_ids: Iterable[str]) -> list[str]:
        """What the connector's workers hold for requests still waiting when the suite's
        wait ran out (handshakes, transfers and their states): evidence for a liveness
        finding, never a verdict. Empty when the driver cannot look."""
        return []

    def peer_output(self) -> list[str]:
        """What the driver's peer processes printed during this scenario that looks like
        a problem (errors, warnings, tracebacks): attached to a failing scenario's
        message as evidence, never judged. Default: no peer processes."""
        return []

    def before_close(self) -> None:
        """Called once the scenario is judged, before the suite closes its engines: a
        driver whose fault killed a service the engines' shutdown talks to (a store's
        master) may start it again, empty, so they close promptly instead of waiting out
        its client's timeouts. Never before the verdict, so nothing it does is judged.
        Default: nothing."""

    def scenario_failed(self) -> None:
        """Called before :meth:`after_scenario` when the scenario's verdict was a failure
        or an error: a driver may stop trusting the peers that scenario used."""

    def after_scenario(self) -> None:
        """Called after every scenario, once its engines are closed and their handles
        dropped: repair shared peers."""


def declared_capabilities(driver: Any) -> dict[str, tuple[bool, str]]:
    """What ``driver`` declares plus what it implements
    (:data:`kvfail.conformance.abilities.ABILITIES`).

    A driver whose table has a point of :data:`POINT_NEEDS` must implement its protocol
    (the scenario asks it where the late write landed). A
    ``declared()`` of the older form, a dict of names, still loads, with a warning; an
    ability it names must agree with what the class implements."""
    for point, protocol in POINT_NEEDS.items():
        if point in driver.faults and not isinstance(driver, protocol):
            raise TypeError(
                f"driver {driver.name!r} provokes {point.value} but does not implement "
                f"{protocol.__name__}"
            )
    found = abilities(driver)
    declared = driver.declared()
    if isinstance(declared, Declared):
        return {**declared.claims(), **found}
    warnings.warn(
        f"driver {driver.name!r}: declared() returning a dict is deprecated: return a "
        "kvfail.conformance.driver.Declared",
        DeprecationWarning,
        stacklevel=3,
    )
    claims = {k: (bool(v[0]), str(v[1])) for k, v in dict(declared).items()}
    for key, (has, why) in found.items():
        if key in claims and claims[key][0] != has:
            raise TypeError(f"driver {driver.name!r} declares {key}={claims[key][0]}, but {why}")
    return {**claims, **found}
