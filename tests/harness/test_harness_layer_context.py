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

from kvfail.conformance.store_driver import write_pattern, wrong_positions

pytestmark = pytest.mark.vllm

PROMPT_LEN = 100
BLOCK = 32
LOADED = (PROMPT_LEN - 2) // BLOCK * BLOCK  # what ExampleConnector matches for the prompt


def _mismatches(engine: Any, req_id: str) -> list[str]:
    return wrong_positions(engine, req_id, LOADED)


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
    p = make_engine(forward=write_pattern, **_spec(tmp_path, "producer"))
    p.add_request("p-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=1)
    p.run_until_idle(max_steps=10)
    assert p.crashed is None, p.crashed
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == len(p.built.layer_names)  # one file per layer, really on disk
    return files


def _consume(make_engine: Any, tmp_path: Path) -> Any:
    d = make_engine(**_spec(tmp_path, "consumer"))
    d.add_request("d-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=3)
    d.step()
    return d


def test_example_connector_loads_the_bytes_p_wrote(make_engine: Any, tmp_path: Path) -> None:
    _produce(make_engine, tmp_path)
    d = _consume(make_engine, tmp_path)
    assert d.crashed is None, d.crashed
    assert _mismatches(d, "d-0") == []


def test_without_layer_context_nothing_is_loaded(make_engine: Any, tmp_path: Path) -> None:
    """The control: the same D without the layer context skips the load silently."""
    _produce(make_engine, tmp_path)
    spec = {**_spec(tmp_path, "consumer"), "layer_forward_context": False}
    d = make_engine(**spec)
    d.add_request("d-0", prompt_len=PROMPT_LEN, prompt_seed="shared", max_tokens=3)
    d.step()
    assert d.crashed is None
    assert len(_mismatches(d, "d-0")) > 0


def test_deleted_file_escapes_start_load_kv(make_engine: Any, tmp_path: Path) -> None:
    files = _produce(make_engine, tmp_path)
    files[0].unlink()
    d = _consume(make_engine, tmp_path)
    assert d.crashed is not None
    assert d.crashed.exc_type == "FileNotFoundError"


def test_overwritten_data_is_reported_as_success_with_wrong_bytes(
    make_engine: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    files = _produce(make_engine, tmp_path)
    tensors = load_file(str(files[0]))
    save_file({k: torch.full_like(v, 7.0) for k, v in tensors.items()}, str(files[0]))
    d = _consume(make_engine, tmp_path)
    assert d.crashed is None
    assert not d.record.kv_reports or all(r.empty for r in d.record.kv_reports)
    assert _mismatches(d, "d-0")  # what only an integrity oracle can see
