"""Blocks a failed transfer may still write into, kept out of the free pool until fenced.

Why: failing a load fast is only safe if its blocks are not handed to another request
while the transfer can still land in them. A Mooncake P that D gave up on may push up to
its own abort timeout later; a NIXL READ whose handle could not be released may still
complete. So a load that failed *unfenced* is reported at once (the client gets its
error, or recompute starts), but each of its blocks keeps one extra reference in vLLM's
block pool, so the scheduler's free of the request does not return it to the pool.
The reference is dropped when every rank that held it says the write is now impossible
(P confirmed dead, P acknowledged a cancel, or P's own expiry passed).

Two halves, in two processes in a real deployment:

* the worker side (:class:`kvfail.tracker.LoadTracker`, its holds kept by
  :mod:`kvfail.tracker_quarantine`) names, each step, the ``(request id, rank)`` pairs it
  quarantined and the ones it released;
* the scheduler side (:class:`BlockQuarantine`, here) applies those notices to the block
  pool, in ``update_connector_output``, which vLLM calls before it frees the blocks of a
  request whose failed load it is told about in the same output.

Recompute must run into fresh blocks: an unfenced failure is reported request-level, so
the scheduler drops everything the load computed and allocates new blocks, while the
held ones stay out of reach. Nothing here imports vLLM; the pool is anything with
vLLM's ``BlockPool.touch`` / ``free_blocks`` (see :mod:`kvfail.vllm_quarantine`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "UNKNOWN_PEER",
    "BlockQuarantine",
    "Hold",
    "NamedHolds",
    "QuarantineNotice",
    "hold_rank",
]

log = logging.getLogger("kvfail.quarantine")

#: A quarantine is per (request id, worker): each worker's transfer writes its own part
#: (its TP shard, its pipeline stage's layers). The int is :func:`hold_rank`'s.
Hold = tuple[str, int]


def hold_rank(tp_rank: int, tp_size: int, pp_rank: int = 0) -> int:
    """A worker's name in the holds: unique over every TP rank of every pipeline stage.

    vLLM merges the KV output of all TP x PP workers into one; keyed by the TP rank
    alone, two stages would share one hold, and the first stage's release would free
    blocks the other stage's transfer may still write."""
    return pp_rank * max(1, tp_size) + tp_rank


@dataclass
class QuarantineNotice:
    """What the workers say in one step: holds taken and holds released.

    Aggregating ranks is a union: a request stays quarantined until every rank that held
    it released it."""

    held: set[Hold] = field(default_factory=set)
    released: set[Hold] = field(default_factory=set)
    #: The P each held request's transfer came from, where the worker knows it.
    peers: dict[str, str] = field(default_factory=dict)

    def merge(self, other: QuarantineNotice) -> QuarantineNotice:
        self.held |= other.held
        self.released |= other.released
        self.peers.update(other.peers)
        return self

    def __bool__(self) -> bool:
        return bool(self.held or self.released)


class BlockPoolLike(Protocol):
    """What the quarantine needs of vLLM's ``BlockPool``."""

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...


#: What a hold's P is called when no worker named it.
UNKNOWN_PEER = "unknown"


class NamedHolds:
    """Mix in before :class:`kvfail.FailureReporterMixin`: each held request in a
    notice is named by its P (:meth:`kvfail_peer_of`), so the scheduler side can count
    held loads per P and name the P of a hold that lasts."""

    def kvfail_peer_of(self, req_id: str) -> str | None:
        """The P (host:port, or whatever names it) a held load's transfer came from."""
        return None

    def take_quarantine_notice(self) -> QuarantineNotice:
        notice: QuarantineNotice = super().take_quarantine_notice()  # type: ignore[misc]
        for req_id, _ in notice.held:
            peer = self.kvfail_peer_of(req_id)
            if peer:
                notice.peers[req_id] = peer
        return notice


@dataclass
class _Held:
    blocks: list[Any]
    ranks: set[int]
    since: float
    peer: str = UNKNOWN_PEER
    said: bool = False


class BlockQuarantine:
    """The scheduler side: one extra reference per block of each quarantined request.

    ``blocks_of(req_id)`` returns the request's block objects (every KV-cache group),
    or None when the scheduler no longer has the request.
    """

    def __init__(
        self,
        pool: BlockPoolLike,
        blocks_of: Callable[[str], Sequence[Any] | None],
        *,
        max_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._blocks_of = blocks_of
        self._clock = clock
        #: Beyond this many held blocks, D takes no new remote load (see :meth:`full`).
        self.max_blocks = max_blocks
        self._held: dict[str, _Held] = {}
        self.blocks_held = 0
        #: Counters since creation, for stats and logs: holds taken and released, holds
        #: that came too late to take, and releases of holds nobody took.
        self.holds = 0
        self.releases = 0
        self.unheld = 0
        self.unknown_releases = 0

    def apply(self, notice: QuarantineNotice) -> None:
        """Take this step's holds, then its releases (a rank may do both in one step)."""
        for req_id, rank in sorted(notice.held):
            self._hold(req_id, rank, notice.peers.get(req_id))
        for req_id, rank in sorted(notice.released):
            self._release(req_id, rank)

    def _hold(self, req_id: str, rank: int, peer: str | None = None) -> None:
        entry = self._held.get(req_id)
        if entry is not None:
            entry.ranks.add(rank)
            if peer and entry.peer == UNKNOWN_PEER:
                entry.peer = peer
            return
        blocks = self._blocks_of(req_id)
        if blocks is None:
            # The scheduler already let the request go: its blocks may be in use by
            # another request, so nothing can be held any more. Loud, because it means
            # a notice came after the free (a worker reported the hold too late).
            self.unheld += 1
            log.error("kvfail: cannot quarantine %s: the scheduler no longer has it", req_id)
            return
        real = [b for b in blocks if not getattr(b, "is_null", False)]
        self._pool.touch(real)
        self._held[req_id] = _Held(real, {rank}, self._clock(), peer or UNKNOWN_PEER)
        self.blocks_held += len(real)
        self.holds += 1
        log.warning(
            "kvfail: %d blocks of %s quarantined until its transfer is fenced", len(real), req_id
        )

    def _release(self, req_id: str, rank: int) -> None:
        entry = self._held.get(req_id)
        if entry is None or rank not in entry.ranks:
            self.unknown_releases += 1
            log.warning("kvfail: release of %s rank %d, which holds nothing", req_id, rank)
            return
        entry.ranks.discard(rank)
        if entry.ranks:
            return
        del self._held[req_id]
        self._pool.free_blocks(entry.blocks)
        self.blocks_held -= len(entry.blocks)
        self.releases += 1
        log.info("kvfail: %s fenced; %d quarantined blocks freed", req_id, len(entry.blocks))

    def oldest_age_s(self) -> float:
        """How long the oldest hold has lasted (0 when nothing is held)."""
        if not self._held:
            return 0.0
        return max(0.0, self._clock() - min(e.since for e in self._held.values()))

    def loads_by_peer(self) -> dict[str, int]:
        """Held loads per P."""
        return dict(Counter(e.peer for e in self._held.values()))

    def say_overdue(self, after_s: float) -> list[str]:
        """One WARNING per hold, naming its P, once it has lasted ``after_s``; the
        requests said now. Nothing is released: a hold ends only by its fence."""
        now = self._clock()
        said: list[str] = []
        for req_id, entry in self._held.items():
            if entry.said or now - entry.since < after_s:
                continue
            entry.said = True
            said.append(req_id)
            log.warning(
                "kvfail: %s has held %d blocks for %.0f s, waiting for proof that P %s no "
                "longer writes into them (%d holds from that P)",
                req_id,
                len(entry.blocks),
                now - entry.since,
                entry.peer,
                sum(1 for e in self._held.values() if e.peer == entry.peer),
            )
        return said

    def full(self) -> bool:
        """Whether D should stop accepting remote loads: held blocks reached the cap."""
        return self.max_blocks is not None and self.blocks_held >= self.max_blocks

    def is_held(self, req_id: str) -> bool:
        return req_id in self._held

    def __len__(self) -> int:
        return len(self._held)
