"""Deterministic per-token KV bytes, shared by the producer (writes) and the consumer (checks).

Why: a P->D pull is only proven correct if D can tell *which* bytes landed where. Every
(layer, token position, prompt seed) gets its own 16-bit words, so a block that arrived in
the wrong slot, from the wrong layer or from another request's prefill fails the check,
and an untouched (zero) block never passes. Only torch is imported, so both sides can use
this before or without vLLM.

Layout assumed (what ``allocate_kv_cache`` gives with LBHNC on CPU): per layer a tensor
``[num_blocks, kv_heads, block_size, C]``; token ``p`` of a request lives in block
``block_ids[p // block_size]``, slot ``p % block_size``, all heads and all ``C`` entries.

The words are a function of the model's *global* KV head (``first_head``: the global index
of the tensor's head 0, a TP rank's shard start), never of the rank that holds it: P and D
may shard the heads differently (P at TP 2, D at TP 1, or the reverse), and a head must
carry the same bytes on both sides wherever it lives.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

__all__ = ["expected_words", "mismatched_positions", "write_pattern"]

_MASK = 0xFFFF


def _seed_hash(prompt_seed: str) -> int:
    return zlib.crc32(prompt_seed.encode())


def expected_words(
    prompt_seed: str, layer: int, positions: torch.Tensor, width: int, first_col: int = 0
) -> torch.Tensor:
    """int16 words ``[len(positions), width]`` for these token positions of one layer,
    columns ``[first_col, first_col + width)`` of the layer's global (all heads) row."""
    base = (_seed_hash(prompt_seed) * 40503 + (layer + 1) * 7919) & _MASK
    pos = positions.to(torch.int64).unsqueeze(1)
    cols = torch.arange(first_col, first_col + width, dtype=torch.int64).unsqueeze(0)
    words = (base + pos * 2654435761 + cols * 97 + 1) & _MASK
    # Map to int16 by wrapping, so the exact bit pattern is what is stored.
    return torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16)


def _index(
    kv: torch.Tensor, block_ids: Sequence[int], start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    words = kv.view(torch.int16)
    block_size = words.shape[2]
    positions = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.tensor(list(block_ids), dtype=torch.int64)[positions // block_size]
    slots = positions % block_size
    return words, positions, blocks, slots


def _pattern_at(
    words: torch.Tensor, positions: torch.Tensor, prompt_seed: str, layer: int, first_head: int
) -> torch.Tensor:
    """The pattern's words for ``positions`` of a layer's int16 ``words``, shaped like
    what they index, ``[positions, heads, width]``: one rule for writing and checking."""
    heads, width = words.shape[1], words.shape[3]
    want = expected_words(prompt_seed, layer, positions, heads * width, first_head * width)
    return want.view(len(positions), heads, width)


def write_pattern(
    kv: torch.Tensor,
    layer: int,
    block_ids: Sequence[int],
    start: int,
    end: int,
    prompt_seed: str,
    first_head: int = 0,
) -> None:
    """Write tokens ``[start, end)`` of a request into one layer's KV tensor, in place
    (``first_head``: the global KV head of the tensor's head 0)."""
    if end <= start:
        return
    words, positions, blocks, slots = _index(kv, block_ids, start, end)
    words[blocks, :, slots, :] = _pattern_at(words, positions, prompt_seed, layer, first_head)


def mismatched_positions(
    kv: torch.Tensor,
    layer: int,
    block_ids: Sequence[int],
    start: int,
    end: int,
    prompt_seed: str,
    first_head: int = 0,
) -> list[int]:
    """Token positions in ``[start, end)`` whose bytes differ from the pattern (empty:
    exact); ``first_head`` as for :func:`write_pattern`."""
    if end <= start:
        return []
    words, positions, blocks, slots = _index(kv, block_ids, start, end)
    want = _pattern_at(words, positions, prompt_seed, layer, first_head)
    got = words[blocks, :, slots, :]
    bad = (got != want).flatten(1).any(dim=1)
    return [int(p) for p in positions[bad]]
