"""A typed model of what a connector supports, derived from the class where possible.

Why: a conformance suite that gates tests by connector *name* lets a connector opt out of
anything; gating by *capability* (SQLAlchemy's requirements, ADBC's feature model) makes
each skip a statement about the connector that can be checked. Whatever can be read from
the class itself is read from it (which hooks it overrides below ``KVConnectorBase_V1``,
whether it implements ``SupportsHMA``); only what introspection cannot see (async vs sync
loads, whether a real transport is behind it) comes from the
driver, which must say so explicitly. Every ``False`` carries the reason that is printed in
the skip: ``requires hma: ToyConnector does not implement SupportsHMA``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, NamedTuple

from kvfail.faults.points import FaultPoint

__all__ = [
    "CAPABILITY_NAMES",
    "Capabilities",
    "CapabilityMissing",
    "Claim",
    "Declared",
    "derive_from_class",
    "overrides_below_base",
]


class CapabilityMissing(Exception):
    """Raised by :meth:`Capabilities.require`; the scenario context turns it into a
    :class:`~kvfail.conformance.suite.SuiteSkip` naming the capability."""


def overrides_below_base(cls: type, method: str, base: type) -> bool:
    """True when a class in ``cls``'s MRO *before* ``base`` defines ``method`` itself.

    Why not ``getattr``: every connector inherits vLLM's default, so only a definition in
    the class's own ``__dict__`` (or a mixin's, like kvfail's reporter) counts.
    """
    for klass in cls.__mro__:
        if klass is base:
            return False
        if method in klass.__dict__:
            # A class that sets the name back to the base's own function overrides nothing.
            return klass.__dict__[method] is not base.__dict__.get(method)
    return False


def derive_from_class(cls: type) -> dict[str, tuple[bool, str]]:
    """Introspect a connector class: capability -> (supported, why not / evidence)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    name = cls.__name__
    out: dict[str, tuple[bool, str]] = {}
    if not issubclass(cls, KVConnectorBase_V1):
        reason = f"{name} is not a KVConnectorBase_V1"
        return {k: (False, reason) for k in ("block_level_failures", "request_level_failures")}
    block = overrides_below_base(cls, "get_block_ids_with_load_errors", KVConnectorBase_V1)
    out["block_level_failures"] = (
        block,
        f"{name} overrides get_block_ids_with_load_errors"
        if block
        else f"{name} does not override get_block_ids_with_load_errors",
    )
    request = overrides_below_base(cls, "get_transfer_results", KVConnectorBase_V1)
    out["request_level_failures"] = (
        request,
        f"{name} overrides get_transfer_results"
        if request
        else f"{name} does not override get_transfer_results (failed_recving stays empty)",
    )
    hma = issubclass(cls, SupportsHMA)
    out["hma"] = (
        hma,
        f"{name} implements SupportsHMA" if hma else f"{name} does not implement SupportsHMA",
    )
    return out


class Claim(NamedTuple):
    """One declared capability: whether it holds, and the evidence (when it does) or the
    reason (when it does not) that the report and every skip print."""

    holds: bool
    why: str


@dataclass(frozen=True)
class Declared:
    """What a driver declares about its connector that introspection cannot see.

    Why a dataclass and not a dict of names: every driver answers the same questions, and
    a question left out or misspelled is a ``TypeError`` where the driver builds it, not a
    capability silently false. The abilities a driver *implements* (checking D's bytes,
    breaking params: ``kvfail.conformance.driver.ByteOracle``, ``MalformedParams``) are
    not declared here: they are read from the driver class, as these cannot be.
    """

    async_load: Claim
    sync_load: Claim
    #: The driver can set up a remote prefill this connector loads from (a peer P).
    remote_prefill: Claim
    #: The driver can build D with two KV-cache groups (HMA layouts).
    two_groups: Claim
    real_transport: Claim
    tp2: Claim
    #: The driver can build P at another TP size than D (``--layout p2d1`` / ``p1d2``),
    #: its builds take ``p_tp_size``.
    hetero_tp: Claim

    @classmethod
    def nothing(cls, why: str) -> Declared:
        """Every claim false, for one reason (a driver that cannot feed its connector)."""
        return cls(**{f.name: Claim(False, why) for f in fields(cls)})

    def claims(self) -> dict[str, tuple[bool, str]]:
        """Capability name -> (holds, why), as :meth:`Capabilities.build` takes them."""
        return {
            f.name: (bool(c.holds), c.why) for f in fields(self) for c in [getattr(self, f.name)]
        }


@dataclass(frozen=True)
class Capabilities:
    """What the suite may expect from one connector under one driver.

    ``reasons`` holds, for every capability, the evidence (when True) or the explanation
    (when False) printed in the skip message. ``faults`` are the named fault points the
    driver can provoke; a scenario needing one the driver lacks is skipped naming it.
    """

    connector: str
    driver: str
    #: The exact class, ``module:qualname`` (what a baseline entry names).
    connector_path: str = ""
    async_load: bool = False
    sync_load: bool = False
    request_level_failures: bool = False
    block_level_failures: bool = False
    hma: bool = False
    #: The driver can set up a remote prefill this connector loads from (a peer P).
    remote_prefill: bool = False
    #: The driver can build D with two KV-cache groups (HMA layouts).
    two_groups: bool = False
    real_transport: bool = False
    tp2: bool = False
    #: The driver can build P at another TP size than D (heterogeneous-TP layouts).
    hetero_tp: bool = False
    byte_verification: bool = False
    #: The driver can hand D broken ``kv_transfer_params`` (missing / unusable fields).
    malformed_params: bool = False
    faults: frozenset[FaultPoint] = frozenset()
    reasons: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    #: Fault point -> the TP ranks the driver cannot hit with it alone, each with why
    #: (``Injector.not_alone``): a scenario faults such a rank another way or skips it.
    rank_limits: Mapping[FaultPoint, Mapping[int, str]] = field(
        default_factory=dict, hash=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))
        limits = {p: MappingProxyType(dict(r)) for p, r in self.rank_limits.items() if r}
        object.__setattr__(self, "rank_limits", MappingProxyType(limits))

    @classmethod
    def build(
        cls,
        connector_cls: type,
        *,
        driver: str,
        faults: Iterable[FaultPoint] = (),
        declared: Declared | Mapping[str, tuple[bool, str]] | None = None,
        rank_limits: Mapping[FaultPoint, Mapping[int, str]] | None = None,
    ) -> Capabilities:
        """Introspected capabilities of ``connector_cls`` plus what the driver declares.

        A driver may only *add* capabilities that introspection cannot see; it cannot
        override an introspected one (a driver claiming HMA for a class without
        ``SupportsHMA`` is refused), so a skip can never be bought by the driver.
        """
        derived = derive_from_class(connector_cls)
        declared = declared.claims() if isinstance(declared, Declared) else dict(declared or {})
        clash = set(derived) & set(declared)
        if clash:
            raise ValueError(f"driver {driver!r} may not declare introspected {sorted(clash)}")
        merged = {**declared, **derived}
        known = set(CAPABILITY_NAMES)
        kwargs: dict[str, Any] = {}
        reasons: dict[str, str] = {}
        for key, (value, why) in merged.items():
            if key not in known:
                raise ValueError(f"unknown capability {key!r} from driver {driver!r}")
            kwargs[key] = value
            reasons[key] = why
        for name in known - set(kwargs):
            reasons.setdefault(name, f"driver {driver!r} does not declare {name}")
        return cls(
            connector=connector_cls.__name__,
            connector_path=f"{connector_cls.__module__}:{connector_cls.__qualname__}",
            driver=driver,
            faults=frozenset(faults),
            reasons=reasons,
            rank_limits=dict(rank_limits or {}),
            **kwargs,
        )

    def missing(self, name: str) -> str | None:
        """None when supported, else the skip message naming the capability."""
        if name not in CAPABILITY_NAMES:
            raise KeyError(f"unknown capability {name!r}")
        if getattr(self, name):
            return None
        return f"requires {name}: {self.reasons.get(name, 'not supported')}"

    def require(self, *names: str) -> None:
        """Raise :class:`CapabilityMissing` naming the first missing capability."""
        for name in names:
            why = self.missing(name)
            if why is not None:
                raise CapabilityMissing(why)

    def require_fault(self, *candidates: FaultPoint) -> FaultPoint:
        """The first of ``candidates`` the driver can provoke, or a skip naming them."""
        for point in candidates:
            if point in self.faults:
                return point
        wanted = ", ".join(p.value for p in candidates)
        have = ", ".join(sorted(p.value for p in self.faults)) or "none"
        raise CapabilityMissing(
            f"requires fault {wanted}: driver {self.driver!r} advertises only [{have}]"
        )

    def require_fault_on_rank(self, rank: int, *candidates: FaultPoint) -> FaultPoint:
        """The first of ``candidates`` the driver can provoke on TP rank ``rank`` alone
        (advertised, and ``rank`` not in its :attr:`rank_limits`), or a skip naming each
        candidate and why it cannot."""
        why: list[str] = []
        for point in candidates:
            if point not in self.faults:
                why.append(f"{point.value}: not advertised")
                continue
            limit = self.rank_limits.get(point, {}).get(rank)
            if limit is None:
                return point
            why.append(f"{point.value}: {limit}")
        raise CapabilityMissing(
            f"requires a fault on TP rank {rank} alone: driver {self.driver!r} has none "
            f"({'; '.join(why)})"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view for ``report.json``."""
        out: dict[str, Any] = {name: getattr(self, name) for name in CAPABILITY_NAMES}
        out["faults"] = sorted(p.value for p in self.faults)
        out["connector"], out["driver"] = self.connector, self.driver
        out["connector_path"] = self.connector_path
        out["reasons"] = dict(self.reasons)
        out["rank_limits"] = {
            p.value: {str(r): why for r, why in limits.items()}
            for p, limits in sorted(self.rank_limits.items())
        }
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Capabilities:
        """The capabilities :meth:`as_dict` wrote (a distributed run's worker sends them)."""
        kwargs = {name: bool(data.get(name, False)) for name in CAPABILITY_NAMES}
        return cls(
            connector=str(data["connector"]),
            driver=str(data["driver"]),
            connector_path=str(data.get("connector_path", "")),
            faults=frozenset(FaultPoint(v) for v in data.get("faults", ())),
            reasons=dict(data.get("reasons", {})),
            rank_limits={
                FaultPoint(p): {int(r): str(why) for r, why in limits.items()}
                for p, limits in data.get("rank_limits", {}).items()
            },
            **kwargs,
        )


#: The boolean capabilities a scenario may require.
CAPABILITY_NAMES: tuple[str, ...] = tuple(
    f.name
    for f in fields(Capabilities)
    if f.name not in ("connector", "connector_path", "driver", "faults", "reasons", "rank_limits")
)
