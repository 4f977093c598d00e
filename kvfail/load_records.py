"""What the load tracker keeps per load, and what its drain delivers.

Apart from :mod:`kvfail.tracker` because these are plain values: the mixin and the
negative controls read a :class:`StepReport` or a :class:`Failure` without the tracker's
locking and bookkeeping.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Final

from kvfail.stages import Stage


class _AllPeers:
    __slots__ = ()

    def __repr__(self) -> str:
        return "ALL_PEERS"


#: Pass as ``peer=`` to settle every outstanding peer task of a load at once.
ALL_PEERS: Final = _AllPeers()


@dataclass(frozen=True, slots=True)
class Failure:
    stage: Stage
    reason: str
    peer: Hashable | None
    at: float


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one drain delivers. Treat the sets as read-only: the idle report is shared."""

    finished_recving: AbstractSet[str]
    failed_recving: AbstractSet[str]
    invalid_block_ids: AbstractSet[int]
    failures: tuple[tuple[str, Failure], ...] = ()
    #: Failed loads no channel of this vLLM can carry (no block to name, no
    #: ``failed_recving``): never to be delivered as finished (see the mixin).
    unreportable: AbstractSet[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(
            self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.unreportable
        )


IDLE_REPORT: Final = StepReport(frozenset(), frozenset(), frozenset())


@dataclass(slots=True, eq=False)
class Load:
    req_id: str
    groups: tuple[tuple[int, ...], ...]
    flat: tuple[int, ...]
    pending: set[Hashable]
    started: float
    deadline: float
    failure: Failure | None = None
    #: Blocks named by narrowed failure reports (``block_ids=``), united across reports.
    failed_blocks: set[int] | None = None
    #: Some outcome left every block possibly unwritten: a failure that named no block
    #: of the load, bad input, or a peer still silent at the deadline. Narrowing never
    #: clears it: one peer's narrowed report says nothing about another peer's writes.
    all_blocks_failed: bool = False
    #: Set when we must fail the request but hold no block ids we could name.
    request_level_only: bool = False
    settled: bool = False
    #: The load failed while its transfer may still write into its blocks (see
    #: :meth:`LoadTracker.failed`'s ``fenced``): with quarantine it is delivered at once
    #: and its blocks are held until :meth:`LoadTracker.fenced` or the fence succeeds.
    unfenced: bool = False

    @property
    def notify_only(self) -> bool:
        """No blocks to load (``abort_immediately``): its request is already gone."""
        return not self.flat and not self.request_level_only


def no_peers_problem(peers: object) -> str:
    return f"no peers to load from (peers={peers!r}): nobody will write its blocks"


def peer_set(peers: int | Iterable[Hashable]) -> set[Hashable]:
    if isinstance(peers, bool):
        return set()
    if isinstance(peers, int):
        return set(range(max(peers, 0)))
    return set(peers)


def as_stage(stage: Stage | str) -> Stage:
    try:
        return Stage(stage)
    except ValueError:
        return Stage.INTERNAL
