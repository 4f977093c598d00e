"""The requests an engine serves: deterministic prompts, the token the played model
runner samples, and real ``vllm.v1.request.Request`` objects.

Why deterministic: P and D must agree on a prompt without sharing state (same seed, same
tokens), and a run must replay; so prompts and sampled tokens are hashes, never random.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.request import Request

__all__ = [
    "FIRST_FREE_TOKEN",
    "ensure_none_hash",
    "new_request",
    "prompt_tokens",
    "sampled_token",
]

#: Token ids below this are never generated (0-2 are pad/bos/eos in the shipped models),
#: so a request ends by ``max_tokens`` and never by an accidental EOS.
FIRST_FREE_TOKEN = 3

_NONE_HASH_READY = False


def ensure_none_hash() -> None:
    """``init_none_hash`` once per process, as the engine core does at start-up."""
    global _NONE_HASH_READY
    if not _NONE_HASH_READY:
        init_none_hash(sha256)
        _NONE_HASH_READY = True


def _token(key: str, vocab_size: int) -> int:
    return FIRST_FREE_TOKEN + zlib.crc32(key.encode()) % (vocab_size - FIRST_FREE_TOKEN)


def prompt_tokens(seed: str, length: int, vocab_size: int) -> list[int]:
    """Deterministic prompt: same seed, same tokens (so P and D can share a prompt), and
    different seeds share no prefix block in practice (so prefix caching stays out of the
    way unless a test wants it)."""
    return [_token(f"{seed}:{i}", vocab_size) for i in range(length)]


def sampled_token(request_id: str, num_tokens: int, vocab_size: int) -> int:
    """The token the played model runner samples for a request that has ``num_tokens``."""
    return _token(f"{request_id}:{num_tokens}", vocab_size)


def new_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None,
    eos_token_id: Any,
    block_hasher: Callable[[Request], Any],
) -> Request:
    """A real ``Request`` as the engine core builds one from an API call, the connector's
    ``kv_transfer_params`` in its sampling params' ``extra_args``."""
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    params.update_from_generation_config({}, eos_token_id)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
    )
