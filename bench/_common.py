"""Shared bits of the core benchmarks: the upstream-style baseline and output format."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvfail import FailureReporterMixin


class UpstreamStyleWorker:
    """The way connectors drain failures today: one ``queue.Queue`` per channel, emptied
    with ``get_nowait`` until ``queue.Empty`` (a queue of block-id sets for the block
    channel, a queue of request ids for the request channel)."""

    def __init__(self) -> None:
        self.invalid_q: queue.Queue[set[int]] = queue.Queue()
        self.failed_q: queue.Queue[str] = queue.Queue()

    def report(self, req_id: str, blocks: set[int]) -> None:
        self.invalid_q.put(blocks)
        self.failed_q.put(req_id)

    def step(self) -> tuple[set[str], set[int]]:
        failed: set[str] = set()
        while True:
            try:
                failed.add(self.failed_q.get_nowait())
            except queue.Empty:
                break
        invalid: set[int] = set()
        while True:
            try:
                invalid |= self.invalid_q.get_nowait()
            except queue.Empty:
                break
        return failed, invalid


class KvfailWorker(FailureReporterMixin):
    def __init__(self, deadline_s: float | None = 30.0) -> None:
        self.init_failure_reporter(
            num_kv_cache_groups=1, request_level_channel=True, default_deadline_s=deadline_s
        )

    def step(self) -> tuple[object, set[int]]:
        return self.drain_step(), self.get_block_ids_with_load_errors()


def quiet() -> None:
    """Per-failure log lines are real work, but not the work measured here."""
    logging.getLogger("kvfail").setLevel(logging.CRITICAL)


def figures(**values: float) -> str:
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )


@dataclass
class DetectionCase:
    """One request of one side (upstream or kvfail) under one fault, in a detection bench."""

    fault: str
    side: str
    consumer: str
    req_id: str
    injected_at: float = 0.0
    ended_at: float | None = None
    steps: int | None = None
    outcome: str = "pending"
    stage: str = ""

    def elapsed_text(self, unreached: str = "") -> str:
        """Seconds from injection to the terminal state, or the outcome if never reached."""
        if self.ended_at is None:
            return self.outcome + unreached
        return f"{self.ended_at - self.injected_at:.3f}"


CaseT = TypeVar("CaseT", bound=DetectionCase)


def step_until_settled(
    cases: Sequence[CaseT],
    decoders: Mapping[str, Any],
    cap_s: float,
    settle: Callable[[CaseT, Any, float], None],
    before_step: Callable[[str], None] | None = None,
) -> None:
    """Step the cases' D engines (``decoders`` by consumer name) round-robin until
    ``settle`` has ended every case or ``cap_s`` has passed since the first injection; a
    case still open is marked with the cap. Each detection bench judges "ended" its own
    way (``settle``) but must pace and cap its cases alike, or the two transports'
    figures would not compare."""
    engines = {c.consumer: decoders[c.consumer] for c in cases}
    start = min(c.injected_at for c in cases)
    while True:
        now = time.monotonic()
        for c in cases:
            if c.ended_at is None:
                settle(c, engines[c.consumer], now)
        if all(c.ended_at is not None for c in cases) or now - start >= cap_s:
            break
        for key, engine in engines.items():
            if before_step is not None:
                before_step(key)
            engine.step()
        time.sleep(0.002)
    for c in cases:
        if c.ended_at is None:
            c.outcome = f">{cap_s:g}s"
