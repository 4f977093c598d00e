"""A tiny random-weight Llama checkpoint, generated locally, offline and seeded.

Why random weights and not ``--load-format dummy``: dummy init (uniform ±1e-3) gives a
degenerate output that does not change when the KV is wrong or zero, so a test could not
tell a correct transfer from a broken one. With ``initializer_range=0.2`` the output depends
on the KV. Why ``head_dim`` 32: CPU attention rejects head size 16 (hidden 64 / 4 heads) on the
first request, after the server has already reported healthy.

Run as ``python -m e2e.model DIR`` (a subprocess keeps transformers out of the test process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

#: The shipped config: a 2-layer Llama, GQA 4/2, head_dim 32 (q_proj 64 -> 128).
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 50000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "initializer_range": 0.2,
}
SEED = 0


def generate(out_dir: Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``out_dir`` (idempotent)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    (out_dir / "config.json").write_text(json.dumps(CONFIG, indent=1))
    torch.manual_seed(SEED)
    cfg = LlamaConfig.from_pretrained(out_dir)
    cfg.initializer_range = 0.2
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained rewrites config.json; keep head_dim explicit whatever it wrote.
    written = json.loads((out_dir / "config.json").read_text())
    written["head_dim"] = CONFIG["head_dim"]
    (out_dir / "config.json").write_text(json.dumps(written, indent=1))
    return out_dir


if __name__ == "__main__":
    print(generate(Path(sys.argv[1])))
