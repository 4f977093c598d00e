"""The byte pattern follows the model's global KV heads, so a P and a D that shard the
heads differently (heterogeneous TP) agree on every head, and a head that lands on the
wrong rank is still caught (the negative control of the heterogeneous layouts' oracle)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kvfail.peers.forwards import first_head
from kvfail.peers.pattern import mismatched_positions, write_pattern

BLOCKS, HEADS, BLOCK_SIZE, WIDTH = 4, 2, 8, 16
IDS = [2, 0]
END = 12  # two blocks' worth of tokens, the second partly


def _kv(heads: int = HEADS) -> torch.Tensor:
    return torch.zeros(BLOCKS, heads, BLOCK_SIZE, WIDTH, dtype=torch.float16)


def _view(rank: int, world: int, local_heads: int, total: int = HEADS) -> Any:
    model = SimpleNamespace(get_total_num_kv_heads=lambda: total)
    built = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model))
    kv = {"layer": _kv(local_heads)}
    return SimpleNamespace(rank=rank, world_size=world, kv_caches=kv, built=built)


def test_first_head_is_the_shard_start() -> None:
    assert first_head(_view(0, 1, HEADS)) == 0
    assert [first_head(_view(r, 2, 1)) for r in range(2)] == [0, 1]
    # Ranks simulated in one world hold every head: the whole row, from head 0.
    assert first_head(_view(1, 2, HEADS)) == 0
    # More ranks than heads: each head is replicated on world // total ranks.
    assert [first_head(_view(r, 4, 1)) for r in range(4)] == [0, 0, 1, 1]


def test_p_tp2_shards_read_by_d_tp1() -> None:
    shards = [_kv(1), _kv(1)]
    for rank, kv in enumerate(shards):
        write_pattern(kv, 0, IDS, 0, END, "req", first_head=rank)
    d = torch.cat(shards, dim=1)
    assert mismatched_positions(d, 0, IDS, 0, END, "req") == []
    # Negative control: P's shards joined in the wrong order (a rank mapped to the wrong
    # head) fail every position, though each shard's bytes are P's own.
    swapped = torch.cat(shards[::-1], dim=1)
    assert mismatched_positions(swapped, 0, IDS, 0, END, "req") == list(range(END))


def test_p_tp1_read_by_d_tp2_halves() -> None:
    p = _kv()
    write_pattern(p, 1, IDS, 0, END, "req")
    for rank in range(2):
        half = p[:, rank : rank + 1].contiguous()
        assert mismatched_positions(half, 1, IDS, 0, END, "req", first_head=rank) == []
        # Negative control: the other rank's half fails.
        assert mismatched_positions(half, 1, IDS, 0, END, "req", first_head=1 - rank)


def test_homogeneous_tp_still_tells_ranks_apart() -> None:
    a, b = _kv(1), _kv(1)
    write_pattern(a, 0, IDS, 0, END, "req", first_head=0)
    write_pattern(b, 0, IDS, 0, END, "req", first_head=1)
    assert mismatched_positions(a, 0, IDS, 0, END, "req", first_head=1) == list(range(END))
    assert mismatched_positions(b, 0, IDS, 0, END, "req", first_head=1) == []
