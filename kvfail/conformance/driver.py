"""The Driver API: how the suite builds, feeds and breaks one connector.

Why a driver and not just a connector class: the scenarios are the same for every
connector, but *how* to give a decode engine D a remote prefill to load, and how to make
that load fail at a named fault point (``kvfail.faults.points``), depends on the
transport. A driver answers exactly those questions and advertises which fault points it
can provoke; those, plus what is introspected from the connector class, are the
connector's :class:`~kvfail.conformance.capabilities.Capabilities`, and every scenario a
driver cannot serve is skipped *naming* the missing capability (csi-sanity's model: skips
are earned from what the driver advertises).

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from kvfail.conformance.capabilities import Capabilities
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.hooks import SplitForward

__all__ = [
    "ENTRY_POINT_GROUP",
    "Declared",
    "Driver",
    "DriverUnavailable",
    "EngineHandle",
    "Fault",
]

ENTRY_POINT_GROUP = "kvfail.drivers"


Declared = dict[str, tuple[Any, str]]


@dataclass(eq=False)
class Fault:
    """One fault armed for one request on one D engine, from arming to provoking.

    :meth:`Driver.arm` makes it and files it on the engine's :class:`EngineHandle`;
    the driver's :meth:`Driver.add_remote_request` takes it from there
    (:meth:`EngineHandle.take_fault`) to set up what must exist before D adds the request,
    and keeps in :attr:`state` whatever it will need later (a frozen P, a late write, a
    step count), so :meth:`Driver.provoke` and the driver's per-step hooks find
    everything about this fault in this one object.
    """

    #: A fault point, or a malformation's name (``Driver.add_malformed_request``).
    point: FaultPoint | str
    request_id: str
    #: The driver's own record of what it did for this fault (None: nothing yet).
    state: Any = None


@dataclass(eq=False)
class EngineHandle:
    """What a driver keeps about one D engine: one object per engine, never a dict keyed
    by ``id(engine)`` (an id is reused once the engine is collected).

    :meth:`Driver.handle` makes it on first use and it lives as long as the engine does.
    A driver that keeps more per engine subclasses it and overrides
    :meth:`Driver.new_handle`.
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


class Driver(ABC, Generic[H]):
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

    def unavailable(self) -> str | None:
        """None when the driver can run, else why not (printed in every skip)."""
        return None

    def start(self) -> None:
        """Start peers (P processes, stores); idempotent."""

    def stop(self) -> None:
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
        """Drop every engine's handle (after a scenario: its engines are closed)."""
        handles = getattr(self, "_handles", None)
        if handles is not None:
            handles.clear()

    def handles(self) -> list[EngineHandle]:
        """The handles of the engines this driver has seen and that still exist."""
        handles = getattr(self, "_handles", None)
        return [] if handles is None else list(handles.values())

    def arm(self, engine: Engine, request_id: str, point: FaultPoint | str) -> Fault:
        """Arm ``point`` for the request about to be added as ``request_id``: call before
        :meth:`add_remote_request`, which sets up whatever must exist before the request
        does (e.g. a bad address in P's ``kv_transfer_params``); the rest happens in
        :meth:`provoke`. Returns the :class:`Fault`, filed on the engine's handle."""
        fault = Fault(point, request_id)
        self.handle(engine).faults[request_id] = fault
        return fault

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

    def wrong_bytes_finding(self, engine: Engine, request_id: str) -> str | None:
        """After any load: why D ran ``request_id`` on KV that is not P's, else None.

        Unlike :meth:`verify_bytes`, a request that was recomputed locally is fine: this is
        the oracle for a failure reported as success (the HF3FS pattern), which under
        ``recompute`` no policy-outcome check can see. Default: cannot tell (None).
        """
        return None

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        """Seconds from adding ``request_id`` to its first report, when the driver timed it."""
        return None

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        """``slow_peer_past_deadline``: None until the slow P's late write for
        ``request_id`` has happened, then what it did (for the report). Only called for a
        load armed with that fault, by a driver that advertises it."""
        raise NotImplementedError(f"driver {self.name!r} has no slow peer")

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

    def add_malformed_request(
        self, engine: Engine, request_id: str, kind: str, *, prompt_len: int = 100
    ) -> str:
        """Add a remote-prefill request whose ``kv_transfer_params`` are broken (``kind``)."""
        raise NotImplementedError(f"driver {self.name!r} cannot build malformed params")

    def peer_output(self) -> list[str]:
        """What the driver's peer processes printed during this scenario that looks like
        a problem (errors, warnings, tracebacks): attached to a failing scenario's
        message as evidence, never judged. Default: no peer processes."""
        return []

    def scenario_failed(self) -> None:
        """Called before :meth:`after_scenario` when the scenario's verdict was a failure
        or an error: a driver may stop trusting the peers that scenario used."""

    def after_scenario(self) -> None:
        """Called after every scenario's engines are closed: repair shared peers."""
