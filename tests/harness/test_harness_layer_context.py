"""The harness's layer forward context: synchronous, layer-wise connectors really load.

vLLM's ExampleConnector (one safetensors file per layer on local disk) loads only when
the forward context carries attention metadata per layer and layers exposing
``kv_cache``; without them it skips the load with a warning and the step "succeeds".
Here P and D are harness engines over a real directory: P's forward writes a known
pattern into its KV slots and the connector saves them (``save_kv_layer`` per layer),
D loads them (``start_load_kv``) and its loaded slots are compared with the pattern.
The two store faults show what the integrity oracle and the crash record must catch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import torch

pytestmark = pytest.mark.vllm

PROMPT_LEN = 100
BLOCK = 32
LOADED = (PROMPT_LEN - 2) // BLOCK * BLOCK  # what ExampleConnector matches for the prompt


def _value(token: int, layer: int) -> float:
    """Exact in float16: a multiple of 1/64 below 32."""
    return ((token % 997) + 3 * layer) % 1024 / 64


def _writer(engine: Any, worker: Any, so: Any) -> None:
    """P's forward: every scheduled token's slot, in every layer, gets its pattern."""
    ctx = engine.layer_context(worker, so)
    order = [(r, p) for r, n in so.num_scheduled_tokens.items() for p in range(n)]
    for i, name in enumerate(engine.built.layer_names):
        view = ctx.layers[name].kv_cache
        slots = ctx.attn_metadata[name].slot_mapping.tolist()
        for (req_id, _p), slot in zip(order, slots, strict=True):
            request = engine.scheduler.requests[req_id]
            pos = request.num_computed_tokens - so.num_scheduled_tokens[req_id] + _p
            view[slot // BLOCK, :, slot % BLOCK] = _value(request.prompt_token_ids[pos], i)


def _mismatches(engine: Any, req_id: str, blocks: list[int]) -> list[str]:
    prompt = engine.requests[req_id].prompt_token_ids
    out: list[str] = []
    for i, name in enumerate(engine.built.layer_names):
        view = engine.workers[0].kv_caches[name]
        for pos in range(LOADED):
            got = view[blocks[pos // BLOCK], :, pos % BLOCK]
            if not torch.all(got == _value(prompt[pos], i)):
                out.append(f"{name} position {pos}")
    return out


def _spec(tmp_path: Path, role: str) -> dict[str, Any]:
    return {
        "connector": "ExampleConnector",
        "connector_module": None,
        "role": role,
        "block_size": BLOCK,
        "layer_forward_context": True,
        "extra_config": {"shared_storage_path": str(tmp_path)},
    }


def _produce(make_engine: Any, tmp_path: Path) -> list[Path]:
    p = make_engine(forward=_writer, **_spec(tmp_path, "producer"))
    p.add_request("p-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=1)
    p.run_until_idle(max_steps=10)
    assert p.crashed is None, p.crashed
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == len(p.built.layer_names)  # one file per layer, really on disk
    return files


def _consume(make_engine: Any, tmp_path: Path) -> tuple[Any, list[int]]:
    d = make_engine(**_spec(tmp_path, "consumer"))
    d.add_request("d-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=3)
    d.step()
    blocks = list(d.scheduler.kv_cache_manager.get_block_ids("d-0")[0]) if d.crashed is None else []
    return d, blocks


def test_example_connector_loads_the_bytes_p_wrote(make_engine: Any, tmp_path: Path) -> None:
    _produce(make_engine, tmp_path)
    d, blocks = _consume(make_engine, tmp_path)
    assert d.crashed is None, d.crashed
    assert _mismatches(d, "d-0", blocks) == []


def test_without_layer_context_nothing_is_loaded(make_engine: Any, tmp_path: Path) -> None:
    """The control: the same D without the layer context skips the load silently."""
    _produce(make_engine, tmp_path)
    spec = {**_spec(tmp_path, "consumer"), "layer_forward_context": False}
    d = make_engine(**spec)
    d.add_request("d-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=3)
    d.step()
    blocks = list(d.scheduler.kv_cache_manager.get_block_ids("d-0")[0])
    assert d.crashed is None
    assert len(_mismatches(d, "d-0", blocks)) > 0


def test_deleted_file_escapes_start_load_kv(make_engine: Any, tmp_path: Path) -> None:
    files = _produce(make_engine, tmp_path)
    files[0].unlink()
    d, _blocks = _consume(make_engine, tmp_path)
    assert d.crashed is not None
    assert d.crashed.exc_type == "FileNotFoundError"


def test_overwritten_data_is_reported_as_success_with_wrong_bytes(
    make_engine: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    files = _produce(make_engine, tmp_path)
    tensors = load_file(str(files[0]))
    save_file({k: torch.full_like(v, 7.0) for k, v in tensors.items()}, str(files[0]))
    d, blocks = _consume(make_engine, tmp_path)
    assert d.crashed is None
    assert not d.record.kv_reports or all(r.empty for r in d.record.kv_reports)
    assert _mismatches(d, "d-0", blocks)  # what only an integrity oracle can see
