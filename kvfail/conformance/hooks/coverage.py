"""The coverage gate: a clause is judged only where a scenario citing it ran to the end.

Why: a connector no driver can feed (the generic driver: no remote prefill) used to skip
every load scenario, pass the one that needs none, and exit 0. A verdict on a clause
needs at least one scenario that exercises it to have run to completion (passed, failed
on the oracles' findings, or absorbed by a baseline entry) for that connector. A clause
is excused only where every selected scenario citing it skipped for an *optional*
capability, a closed set the suite names here: a connector that loads only
asynchronously is not judged on sync loads, one driver's layout or fault point is not
every driver's. Not being able to feed the connector at all (``remote_prefill``) or to
run its driver here (``driver``) excuses nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfail.conformance.capabilities import CAPABILITY_NAMES, Capabilities

__all__ = ["NEVER_EXCUSED", "Ledger", "excused", "genuine"]

#: What a scenario may need that no connector may lack: without a peer to load from, or
#: with its driver unable to run here, nothing is judged.
NEVER_EXCUSED = frozenset({"remote_prefill", "driver"})
#: Needs that are not capability fields but are still the suite's to name.
_OTHER_NEEDS = frozenset({"fault", "layout", "driver"})


def genuine(needs: Iterable[str], caps: Capabilities | None) -> bool:
    """Whether a suite skip names only things the suite knows and that really are
    missing (a forged :class:`~kvfail.conformance.suite.SuiteSkip` names a capability
    the connector has)."""
    needs = tuple(needs)
    if not needs:
        return False
    for need in needs:
        if need in _OTHER_NEEDS:
            continue
        if need not in CAPABILITY_NAMES:
            return False
        if caps is not None and caps.missing(need) is None:
            return False
    return True


def excused(needs: Iterable[str], caps: Capabilities | None) -> bool:
    """Whether a scenario skipped for ``needs`` leaves its clauses unjudged with reason.

    A connector lacks one of async and sync loads, not both: a skip for one is excused
    only where the connector has the other."""
    for need in needs:
        if need in NEVER_EXCUSED:
            return False
        if need == "async_load" and not (caps is not None and caps.sync_load):
            return False
        if need == "sync_load" and not (caps is not None and caps.async_load):
            return False
    return True


@dataclass
class _Clause:
    verified: bool = False
    required: bool = False
    why_not: list[str] = field(default_factory=list)


@dataclass
class Ledger:
    """Per connector and clause: whether a selected scenario citing it required it, and
    whether one ran to a verdict."""

    clauses: dict[str, dict[str, _Clause]] = field(default_factory=dict)

    def note(
        self,
        connector: str,
        scenario: str,
        clauses: Iterable[str],
        *,
        verdict: bool,
        excuse: bool,
        why: str,
    ) -> None:
        """One scenario's end: ``verdict`` when it ran to completion; ``excuse`` when it
        skipped for an optional capability; ``why`` says what happened otherwise."""
        book = self.clauses.setdefault(connector, {})
        for clause in clauses:
            entry = book.setdefault(clause, _Clause())
            if verdict:
                entry.verified = entry.required = True
            elif not excuse:
                entry.required = True
                if len(entry.why_not) < 3 and why:
                    entry.why_not.append(f"{scenario}: {why}")

    def unverified(self) -> list[str]:
        """One line per clause a connector has no verdict on, e.g. ``C1 unverified for
        toy: test_x: skipped (requires remote_prefill: ...)``."""
        out = []
        for connector, book in self.clauses.items():
            for clause in sorted(book, key=lambda c: int(c.lstrip("C") or 0)):
                entry = book[clause]
                if entry.required and not entry.verified:
                    why = "; ".join(entry.why_not) or "no scenario citing it ran to completion"
                    out.append(f"{clause} unverified for {connector}: {why}")
        return out

    def as_dict(self) -> dict[str, dict[str, str]]:
        """JSON-ready: connector -> clause -> verified | excused | unverified."""
        return {
            connector: {
                clause: ("verified" if e.verified else "unverified" if e.required else "excused")
                for clause, e in sorted(book.items(), key=lambda kv: int(kv[0][1:] or 0))
            }
            for connector, book in self.clauses.items()
        }
