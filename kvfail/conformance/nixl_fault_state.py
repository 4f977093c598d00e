"""What a NIXL driver files on a fault for the steps that act on it later: a late READ or
WRITE whose landing is digested at the thaw, and a kill that waits for the provocation.

Apart from :mod:`kvfail.conformance.nixl_driver` because the pull and the push driver
both file them (:mod:`kvfail.conformance.nixl_push_driver` words its late write on
:class:`LateRead`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfail.conformance.driver import LateWriteGate

__all__ = ["KillOnProvoke", "LateRead"]


@dataclass
class LateRead:
    """A ``slow_peer_past_deadline`` READ: its stopped P, D, and what landed at the thaw."""

    producer: Any
    engine: Any
    #: The request's blocks (one tuple per KV-cache group), read while its load waited.
    blocks: tuple[tuple[int, ...], ...] | None = None
    #: Counted from the scenario's first ask for the late write (the load had stopped
    #: waiting); P goes on when it is due.
    gate: LateWriteGate = field(default_factory=LateWriteGate)
    done: str | None = None

    def digests(self) -> list[str]:
        """Each D rank's digest of the blocks (empty: never seen waiting, or D gone)."""
        from kvfail.peers.integrity import block_digest

        if self.blocks is None or self.engine.closed or self.engine.crashed is not None:
            return []
        workers = self.engine.workers
        return [w.call(block_digest, self.blocks, world_size=len(workers)) for w in workers]

    def changed_since(self, before: list[str]) -> tuple[str, str]:
        """Which D ranks' blocks differ from the digests ``before``, and a note when
        there were none to compare, in words."""
        after = self.digests()
        changed = [rank for rank, (a, b) in enumerate(zip(before, after, strict=False)) if a != b]
        where = f"on D rank(s) {changed}" if changed else "on no D rank"
        return where, "" if before else " (the load's blocks were never seen)"

    def settle(self, before: list[str], went_on: str) -> None:
        """Record what P's answer wrote: P went on ``went_on`` (when, in words)."""
        where, seen = self.changed_since(before)
        self.done = (
            f"P, stopped while D's READ was posted, went on {went_on}; "
            f"the load's blocks changed {where} while D did not step{seen}"
        )


@dataclass
class KillOnProvoke:
    """A kill on a warm D: P was stopped when D added the request, and the first
    :meth:`~kvfail.conformance.nixl_driver.NixlDriver.provoke` kills it (see
    ``NixlDriver._kill``)."""

    producer: Any
