"""A bounded wait for the tests: every wait in them has a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(0.01)
    return True


def step_until(
    pair: Any, engine: Any, done: Callable[[], bool], what: str, timeout_s: float
) -> None:
    """Step D ``engine`` of real-peer ``pair``, observing each step as the suite does,
    until ``done()``; fails naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, f"not seen within {timeout_s}s: {what}"
        engine.step()
        pair.observe(engine)
        time.sleep(0.005)


def all_blocks_free(engine: Any) -> bool:
    """Every block of D's pool is free again (the null block never is)."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    return bool(pool.get_num_free_blocks() == engine.spec.num_blocks - 1)
