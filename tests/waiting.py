"""A bounded wait for the tests: every wait in them has a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfail.harness import Engine
    from kvfail.peers.base import PeerPair


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(0.01)
    return True


def step_until(
    pair: PeerPair, engine: Engine, done: Callable[[], bool], what: str, timeout_s: float
) -> None:
    """:meth:`PeerPair.step_until`, failing the test naming ``what`` after ``timeout_s``."""
    assert pair.step_until(engine, done, timeout_s), f"not seen within {timeout_s}s: {what}"
