"""Normalise the block ids a connector hands us into one canonical shape.

vLLM passes per-group block ids (``list[list[int]]`` or ``tuple[list[int], ...]`` under
HMA) to some connectors and flat lists to others. The tracker stores both the per-group
shape (for request-level routing decisions) and a flat tuple (the block-level channel
needs exactly that, and flattening once at registration keeps the drain cheap).

Bad ids are not an exception here: a connector that raises while registering a load
loses the request, which then waits forever. Instead we keep what is valid and tell the
caller what was wrong, so the tracker can fail the load loudly and still report it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockIds = Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class NormalisedBlocks:
    groups: tuple[tuple[int, ...], ...]
    flat: tuple[int, ...]
    #: Human-readable description of rejected input, or "" when everything was valid.
    problem: str

    @property
    def empty(self) -> bool:
        return not self.flat


def _as_block_id(value: object) -> int | None:
    # bool is an int subclass, and True as block 1 is always a bug upstream of us.
    if isinstance(value, bool):
        return None
    try:
        block = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return block if block >= 0 else None


def _is_group(value: object) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes))


def normalise_block_ids(block_ids: object) -> NormalisedBlocks:
    """Accept a flat list (one group) or a list of per-group lists (HMA)."""
    if block_ids is None:
        return NormalisedBlocks((), (), "")
    if not _is_group(block_ids):
        return NormalisedBlocks((), (), f"block ids must be a list, got {type(block_ids).__name__}")
    items = list(block_ids)  # type: ignore[call-overload]
    nested = bool(items) and all(_is_group(x) for x in items)
    raw_groups = [list(g) for g in items] if nested else [items]
    bad: list[object] = []
    groups: list[tuple[int, ...]] = []
    for raw in raw_groups:
        kept: list[int] = []
        for value in raw:
            block = _as_block_id(value)
            if block is None:
                bad.append(value)
            else:
                kept.append(block)
        groups.append(tuple(kept))
    flat = tuple(b for g in groups for b in g)
    problem = ""
    if bad:
        shown = ", ".join(repr(b) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
        problem = f"{len(bad)} invalid block id(s) (need non-negative ints): {shown}"
    return NormalisedBlocks(tuple(groups), flat, problem)
