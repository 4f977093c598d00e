"""A driver's optional abilities: small protocols a driver has by implementing them.

Why protocols and not flags: an ability the suite calls (read D's bytes, land a late
write, hand D broken params) is a method; a driver that has the method has the ability,
so what it declares can never disagree with what it does. :mod:`kvfail.conformance.driver`
re-exports every name here, the API an out-of-tree driver imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine

__all__ = [
    "ABILITIES",
    "LATE_WRITE_STEPS",
    "POINT_NEEDS",
    "ByteOracle",
    "LateWriteGate",
    "LateWrites",
    "MalformedParams",
    "abilities",
]


@runtime_checkable
class ByteOracle(Protocol):
    """A driver that can read D's bytes (capability ``byte_verification``)."""

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        """After a load that should have succeeded: None when D's blocks hold P's bytes,
        else the mismatch (a request D computed itself is one)."""
        ...

    def wrong_bytes_finding(self, engine: Engine, request_id: str) -> str | None:
        """After any load: why D ran ``request_id`` on KV that is not P's, else None. A
        request recomputed locally is fine: this is the oracle for a failure reported as
        success (the HF3FS pattern), which under ``recompute`` no outcome check sees."""
        ...


#: D steps a driver lets pass, once a late-write load stopped waiting, before its P's
#: late write lands: enough for a connector to have freed (or held) the load's blocks,
#: so the write comes when it does the most harm. Steps, not seconds, so the verdict is
#: the same on a loaded machine.
LATE_WRITE_STEPS = 5


@dataclass
class LateWriteGate:
    """When a held late write may land: :data:`LATE_WRITE_STEPS` D steps after the step
    at which the driver first saw its load stop waiting (one gate per late write)."""

    #: D's step count at that first sight; None until then.
    since: int | None = None

    def due(self, steps: int) -> bool:
        """Whether the write may land at D's step count ``steps`` (the first call starts
        the count)."""
        if self.since is None:
            self.since = steps
        return steps - self.since >= LATE_WRITE_STEPS


@runtime_checkable
class LateWrites(Protocol):
    """A driver whose slow P writes after D's deadline: every driver whose table has
    ``slow_peer_past_deadline``."""

    #: Seconds after D added the load at which the slow P answers and writes; None: only
    #: once the load was reported (P never answers first).
    slow_peer_delay_s: float | None

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        """None until the slow P's late write for ``request_id`` has happened, then what
        it did (for the report)."""
        ...


@runtime_checkable
class MalformedParams(Protocol):
    """A driver that can hand D broken ``kv_transfer_params`` (capability
    ``malformed_params``): the scenarios name the breakages ``missing_transfer_id`` and
    ``bad_bootstrap_addr``."""

    def add_malformed_request(
        self, engine: Engine, request_id: str, kind: str, *, prompt_len: int = 100
    ) -> str:
        """Add a remote-prefill request whose ``kv_transfer_params`` are broken (``kind``)."""
        ...


#: Capabilities a driver has by implementing a protocol, not by declaring them.
ABILITIES: Mapping[str, type] = {
    "byte_verification": ByteOracle,
    "malformed_params": MalformedParams,
}


#: Fault points whose scenario calls a driver's optional ability: a driver whose table has
#: one implements that protocol.
POINT_NEEDS: Mapping[FaultPoint, type] = {
    FaultPoint.SLOW_PEER_PAST_DEADLINE: LateWrites,
    FaultPoint.PEER_SHUTDOWN_MID_WRITE: LateWrites,
}


def abilities(driver: object) -> dict[str, tuple[bool, str]]:
    """The capabilities ``driver`` has by what its class implements, with the evidence."""
    cls = type(getattr(driver, "inner", driver)).__name__
    out: dict[str, tuple[bool, str]] = {}
    for name, protocol in ABILITIES.items():
        has = isinstance(driver, protocol)
        verb = "implements" if has else "does not implement"
        out[name] = (has, f"driver {cls} {verb} {protocol.__name__}")
    return out
