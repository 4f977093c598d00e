"""Model-based check of the tracker: random peers, drains, aborts and deadlines.

The reference model is deliberately naive (plain dicts, no lock, no heap) so that it is
obviously right; the tracker must agree with it after every drain. Run the long profile
with ``HYPOTHESIS_PROFILE=slow`` (>= 2,000 examples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvfail import ALL_PEERS, Stage
from tests.core.machines import TrackerStateMachine

IDS = st.sampled_from([f"req-{i}" for i in range(6)])
PEER = st.integers(min_value=0, max_value=2)
BLOCKS = st.lists(st.integers(min_value=0, max_value=40), max_size=4, unique=True)


@dataclass
class ModelLoad:
    blocks: tuple[int, ...]
    pending: set[int]
    deadline: float | None
    failed: bool = False
    settled: bool = False


@dataclass
class Model:
    groups: int
    loads: dict[str, ModelLoad] = field(default_factory=dict)
    recent: set[str] = field(default_factory=set)
    failed_requests: int = 0
    refused: int = 0


class TrackerMachine(TrackerStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model(self.GROUPS)

    # -- helpers on the model side
    def _known(self, req: str) -> ModelLoad | None:
        load = self.model.loads.get(req)
        if load is None:
            self.model.refused += 1
        return load

    def _settle(self, req: str, load: ModelLoad, peer: int | object | None) -> None:
        if load.settled:
            return
        if peer is ALL_PEERS:
            load.pending.clear()
        elif peer is None:
            if load.pending:
                load.pending.pop()
        elif peer in load.pending:
            load.pending.discard(peer)  # type: ignore[arg-type]
        else:
            return
        if not load.pending:
            load.settled = True
            if not load.blocks:
                del self.model.loads[req]
                self.model.recent.add(req)

    def _fail(self, load: ModelLoad) -> None:
        if not load.failed:
            load.failed = True
            if load.blocks:  # a notify-only load is never reported, so never counted
                self.model.failed_requests += 1

    # -- rules
    @rule(
        req=IDS,
        blocks=BLOCKS,
        peers=st.integers(1, 3),
        deadline=st.one_of(st.none(), st.floats(0.5, 5.0)),
    )
    def track(self, req: str, blocks: list[int], peers: int, deadline: float | None) -> None:
        accepted = self.tracker.track(req, blocks, peers=peers, deadline_s=deadline)
        assert accepted == (req not in self.model.loads)
        if accepted:
            self.model.recent.discard(req)
            at = None if deadline is None else self.clock.now + deadline
            self.model.loads[req] = ModelLoad(tuple(blocks), set(range(peers)), at)

    @rule(req=IDS, peer=st.one_of(st.none(), PEER))
    def succeed(self, req: str, peer: int | None) -> None:
        load = self._known(req)
        assert self.tracker.succeeded(req, peer=peer) == (load is not None)
        if load is not None:
            self._settle(req, load, peer)

    @rule(
        req=IDS,
        peer=st.one_of(st.none(), PEER),
        settle=st.booleans(),
        stage=st.sampled_from(list(Stage)),
    )
    def fail(self, req: str, peer: int | None, settle: bool, stage: Stage) -> None:
        load = self._known(req)
        assert self.tracker.failed(req, stage, "x", peer=peer, settle=settle) == (load is not None)
        if load is not None:
            self._fail(load)
            if settle:
                self._settle(req, load, peer)

    @rule(req=IDS)
    def abandon(self, req: str) -> None:
        load = self._known(req)
        self.tracker.failed(req, Stage.BOOTSTRAP, "x", peer=ALL_PEERS)
        if load is not None:
            self._fail(load)
            self._settle(req, load, ALL_PEERS)

    @rule(seconds=st.floats(0.0, 3.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(ok=st.booleans())
    def set_fence(self, ok: bool) -> None:
        self.fence_ok = ok

    @rule()
    def drain(self) -> None:
        now = self.clock.now
        for req, load in list(self.model.loads.items()):
            if not load.settled and load.deadline is not None and load.deadline <= now:
                self._fail(load)
                if self.fence_ok:
                    self._settle(req, load, ALL_PEERS)
        settled = {r: lo for r, lo in self.model.loads.items() if lo.settled}
        failed = {r for r, lo in settled.items() if lo.failed}
        report = self.tracker.drain()
        assert set(report.finished_recving) == set(settled)
        if self.GROUPS == 1:
            assert not report.failed_recving
            assert set(report.invalid_block_ids) == {b for r in failed for b in settled[r].blocks}
        else:
            assert set(report.failed_recving) == failed
            assert not report.invalid_block_ids
        for req in settled:
            del self.model.loads[req]
            self.model.recent.add(req)

    @precondition(lambda self: not self.model.loads)
    @rule()
    def idle_drain_is_empty(self) -> None:
        assert not self.tracker.drain()

    # -- invariants
    @invariant()
    def same_in_flight(self) -> None:
        assert len(self.tracker) == len(self.model.loads)

    @invariant()
    def failures_counted_once_per_request(self) -> None:
        stats = self.tracker.stats()
        assert stats["loads_failed"] == self.model.failed_requests
        assert sum(stats.failed_by_stage.values()) == self.model.failed_requests
        assert stats["unknown_reports"] + stats["late_reports"] == self.model.refused


class HmaTrackerMachine(TrackerMachine):
    """Same model with two KV-cache groups: failures must use the request channel."""

    GROUPS = 2


TestTracker = TrackerMachine.TestCase
TestHmaTracker = HmaTrackerMachine.TestCase


@pytest.fixture(autouse=True)
def _quiet(quiet_kvfail_logs: None) -> None:
    """Random runs fail thousands of loads; their log lines are not under test."""
