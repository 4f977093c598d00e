"""P's "model" (write the byte pattern) and D's check (read it back), for any TP layout.

Why split: with one process per TP rank (``tp_mode="processes"``) the KV tensors live in
the rank processes while block ids and computed-token counts live in the scheduler. So
each side is a :class:`~kvfail.harness.hooks.SplitForward`: the scheduler process plans
(which blocks, which token range, which seed), each rank applies the plan to its own
tensors. The same code runs when the ranks are in-process.

Every rank writes and checks the pattern of the global KV heads it holds
(:func:`first_head`), so bytes that reach the right block of the wrong rank, i.e. the
wrong head shard, fail the check just like bytes in the wrong block, and a P and a D
that shard the heads differently (heterogeneous TP) still agree on every head's bytes.
With two KV-cache groups, layer ``i`` uses the blocks of group ``i % 2``
(``build_kv_cache_config``'s rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfail.peers.pattern import mismatched_positions, write_pattern

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvfail.harness import Engine
    from kvfail.harness.hooks import RankView

__all__ = ["RangeItem", "apply_checks", "apply_writes", "first_head", "plan_writes"]

#: At most this many wrong positions are kept per layer (enough to show the shape).
_KEEP = 8


@dataclass(frozen=True)
class RangeItem:
    """Token range ``[start, end)`` of one request, with its blocks per KV-cache group."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    start: int
    end: int
    seed: str


def first_head(view: RankView) -> int:
    """The global KV head of this rank's head 0: its shard's start when TP shards the
    heads (``rank * total // world``, which also places a replicated head), 0 when the
    rank holds every head (TP 1, or ranks simulated in one world)."""
    total = view.built.vllm_config.model_config.get_total_num_kv_heads()
    local = next(iter(view.kv_caches.values())).shape[1]
    if view.world_size == 1 or local >= total:
        return 0
    return view.rank * total // view.world_size


def request_blocks(engine: Engine, req_id: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in engine.scheduler.kv_cache_manager.get_block_ids(req_id))


def plan_writes(
    engine: Engine, so: SchedulerOutput, seeds: Mapping[str, str]
) -> list[RangeItem] | None:
    """P: the prompt tokens each scheduled request computes this step."""
    items: list[RangeItem] = []
    for req_id, n in so.num_scheduled_tokens.items():
        request = engine.scheduler.requests[req_id]
        # schedule() already advanced num_computed_tokens by this step's tokens.
        start = request.num_computed_tokens - n
        end = min(start + n, request.num_prompt_tokens)
        if end > start:
            seed = seeds.get(req_id, req_id)
            items.append(RangeItem(req_id, request_blocks(engine, req_id), start, end, seed))
    return items or None


def apply_writes(view: RankView, items: list[RangeItem]) -> None:
    head = first_head(view)
    for item in items:
        for layer, name in enumerate(view.built.layer_names):
            blocks = item.block_ids[view.layer_group(layer)]
            kv = view.kv_caches[name]
            write_pattern(kv, layer, blocks, item.start, item.end, item.seed, head)


def apply_checks(view: RankView, items: list[RangeItem]) -> dict[str, dict[str, list[int]]]:
    """D: request -> layer -> wrong token positions (empty dict: every byte right)."""
    out: dict[str, dict[str, list[int]]] = {}
    head = first_head(view)
    for item in items:
        wrong: dict[str, list[int]] = {}
        for layer, name in enumerate(view.built.layer_names):
            blocks = item.block_ids[view.layer_group(layer)]
            bad = mismatched_positions(
                view.kv_caches[name], layer, blocks, item.start, item.end, item.seed, head
            )
            if bad:
                wrong[name] = bad[:_KEEP]
        out[item.req_id] = wrong
    return out
