"""The real client: the ``openai`` package sending token-id completions concurrently.

Why ``max_retries=0``: the SDK retries 5xx by default, which would hide exactly the error a
failed KV load must produce. ``ignore_eos`` keeps every output the same length, so a wrong
token cannot hide behind an early stop.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import openai

MAX_TOKENS = 8


@dataclass
class Outcome:
    """What the client saw for one request."""

    prompt_idx: int
    status: int  # HTTP status; 0 = no response (connection error / client timeout)
    finish_reason: str | None
    token_ids: list[int] | None
    error: str | None
    elapsed_s: float
    done_at: float

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.finish_reason in ("length", "stop")

    @property
    def failed(self) -> bool:
        """An error the caller can see: HTTP >= 500, no response, or finish_reason error."""
        return self.status >= 500 or self.status == 0 or self.finish_reason == "error"


def prompts(n: int, length: int = 160, seed: int = 1234) -> list[list[int]]:
    """Distinct token-id prompts (>= 130 tokens: more than one 128-token CPU block)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 49_000) for _ in range(length)] for _ in range(n)]


async def complete(
    base_url: str, model: str, prompt: list[int], idx: int, timeout_s: float = 120.0
) -> Outcome:
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=timeout_s
    )
    t0 = time.monotonic()
    try:
        r = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        choice = r.choices[0]
        extra = choice.model_extra or {}
        return Outcome(
            idx,
            200,
            choice.finish_reason,
            extra.get("token_ids"),
            None,
            time.monotonic() - t0,
            time.monotonic(),
        )
    except openai.APIStatusError as exc:
        return Outcome(
            idx,
            exc.status_code,
            None,
            None,
            str(exc)[:300],
            time.monotonic() - t0,
            time.monotonic(),
        )
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        return Outcome(idx, 0, None, None, repr(exc)[:300], time.monotonic() - t0, time.monotonic())
    finally:
        await client.close()


async def complete_all(
    base_url: str, model: str, batch: list[list[int]], first_idx: int = 0
) -> list[Outcome]:
    """All prompts at once, concurrently."""
    return list(
        await asyncio.gather(
            *(complete(base_url, model, p, first_idx + i) for i, p in enumerate(batch))
        )
    )
