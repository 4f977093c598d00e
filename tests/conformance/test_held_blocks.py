"""How the suite waits for blocks a connector holds back (``ScenarioContext.await_held_blocks``).

A hold that never ends is waited out once per engine: a scenario that waits for its
blocks itself (the quarantine scenarios) and the leak oracle's wait after it share one
bound, so the oracle does not step D through a second bound for the same hold. A new
request starts a new bound. An idle D (no request, no pending connector work) is not
stepped by vLLM, so no block can come back in it: the wait ends there. D here is a fake
with a block pool and a connector hold, so each claim is counted in steps and calls,
never timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfail.conformance import suite
from kvfail.conformance.suite import HeldBlocks, ScenarioContext

#: D's blocks, the null block included (so every block but one can be free).
NUM_BLOCKS = 8
#: A bound the tests spend in a few steps (the suite's is seconds of an idle machine).
SHORT_BOUND_S = 0.05


@dataclass
class _Pool:
    free: int

    def get_num_free_blocks(self) -> int:
        return self.free


@dataclass
class _Scheduler:
    pool: _Pool
    unfinished: int = 0

    @property
    def kv_cache_manager(self) -> Any:
        return type("Manager", (), {"block_pool": self.pool})()

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


@dataclass
class _Spec:
    num_blocks: int = NUM_BLOCKS


@dataclass
class _FakeD:
    """D with ``held`` blocks a connector keeps back; ``release_after`` steps (None:
    never) give them back; ``pending`` is the connector's pending work (vLLM steps D
    while it has some, through ``has_pending_push_work``)."""

    held: int
    release_after: int | None = None
    pending: bool = True
    steps: int = 0
    crashed: Any = None
    spec: _Spec = field(default_factory=_Spec)
    requests: dict[str, Any] = field(default_factory=lambda: {"warmup": None, "load": None})

    def __post_init__(self) -> None:
        self.scheduler = _Scheduler(_Pool(NUM_BLOCKS - 1 - self.held))

    def is_idle(self) -> bool:
        return not (self.scheduler.unfinished or self.pending)

    def step(self) -> None:
        self.steps += 1
        if self.release_after is not None and self.steps >= self.release_after:
            self.scheduler.pool.free = NUM_BLOCKS - 1
            self.pending = False


@dataclass
class _Driver:
    ended: int = 0
    observed: int = 0

    def end_faults(self, engine: Any) -> None:
        self.ended += 1

    def observe(self, engine: Any) -> None:
        self.observed += 1


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "HELD_BLOCKS_WAIT_S", SHORT_BOUND_S)
    monkeypatch.setattr(suite, "HELD_BLOCKS_POLL_S", 0.001)


def _context(driver: _Driver) -> ScenarioContext:
    return ScenarioContext(driver=driver, caps=None, policy="fail", scenario="held")  # type: ignore[arg-type]


@pytest.mark.usefixtures("short_bound")
def test_a_hold_that_never_ends_is_waited_out_once_per_engine() -> None:
    driver, d = _Driver(), _FakeD(held=4)
    ctx = _context(driver)
    first = ctx.await_held_blocks(d)  # the scenario's own wait
    assert (first.free, first.idle) == (NUM_BLOCKS - 5, False), first
    assert d.steps > 0 and driver.ended == 1
    stepped = d.steps
    second = ctx.await_held_blocks(d)  # the leak oracle's, after it
    assert second == HeldBlocks(NUM_BLOCKS - 5, second.waited_s, idle=False)
    assert d.steps == stepped, "the oracle stepped D through a second bound for one hold"
    assert driver.ended == 1, "the peers' faults were ended twice for one hold"


@pytest.mark.usefixtures("short_bound")
def test_a_new_request_starts_a_new_bound() -> None:
    driver, d = _Driver(), _FakeD(held=4)
    ctx = _context(driver)
    ctx.await_held_blocks(d)
    stepped = d.steps
    d.requests["next"] = None
    ctx.await_held_blocks(d)
    assert d.steps > stepped
    assert driver.ended == 2


def test_blocks_that_come_back_end_the_wait_at_once() -> None:
    driver, d = _Driver(), _FakeD(held=4, release_after=3)
    back = _context(driver).await_held_blocks(d)
    assert (back.free, back.idle, d.steps) == (NUM_BLOCKS - 1, False, 3), back


def test_an_idle_d_ends_the_wait_without_a_step() -> None:
    """No request and no pending connector work: vLLM would not step D, so nothing can
    come back; the caller is told D went idle (the quarantine scenarios' leak finding)."""
    driver, d = _Driver(), _FakeD(held=4, pending=False)
    back = _context(driver).await_held_blocks(d, want=NUM_BLOCKS - 1)
    assert (back.free, back.idle, d.steps) == (NUM_BLOCKS - 5, True, 0), back


def test_no_wait_while_a_request_is_unfinished() -> None:
    driver, d = _Driver(), _FakeD(held=4)
    d.scheduler.unfinished = 1
    back = _context(driver).await_held_blocks(d)
    assert (back.waited_s, d.steps, driver.ended) == (0.0, 0, 0), back
