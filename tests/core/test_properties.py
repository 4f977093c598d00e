"""Hypothesis properties of the tracker, each one rule, over random multi-peer loads.

The machine keeps the ground truth of what each peer did (who reported a failure and
which blocks it named, who succeeded, who was still silent at a drain past the deadline)
and, at each drain, checks what the tracker delivered against it:

* coverage: a delivered failure names every block that any report, or any silent peer,
  leaves possibly unwritten (under ``recompute`` a block left out is served as computed);
* all gone: a load whose peers all failed or were silent (or that had none) is never
  delivered as a success;
* memory: the tracker's maps, sets and heap stay bounded by its in-flight loads (and a
  constant) for every kind of load: normal, narrowed, notify-only, aborted, and reports
  that arrive late, which are still recognised as late while recent.

``HYPOTHESIS_PROFILE=slow`` runs many more examples.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfail import ALL_PEERS, LoadTracker, Stage
from kvfail.stages import Stage as StageEnum
from kvfail.stats import EVENT_COUNTERS
from tests.core.fakes import ManualClock

REQS = [f"req-{i}" for i in range(5)]
#: Ids that are reported but never tracked.
GHOSTS = ["ghost-0", "ghost-1"]
#: Peer names are 0..n-1 (so ``peers=n`` and ``peers=[0, .., n-1]`` name the same tasks);
#: peer 3 never belongs to a load.
PEER = st.one_of(st.integers(0, 3), st.just(ALL_PEERS))
BLOCK = st.integers(min_value=0, max_value=11)
PLACEHOLDER = "awaiting-bootstrap"
#: Small, so that a few dozen steps turn the recent-id generations over several times.
RECENT_KEPT = 3


@dataclass
class Truth:
    """What really happened to one load, as its peers did it."""

    blocks: frozenset[int]
    peers: frozenset[int]
    deadline: float | None
    pending: set[int]
    failed_peers: set[int] = field(default_factory=set)
    silent_peers: set[int] = field(default_factory=set)
    #: Blocks claimed by narrowed reports; ``every_block`` when a claim covers them all.
    claimed: set[int] = field(default_factory=set)
    every_block: bool = False
    failed: bool = False
    settled: bool = False

    @property
    def unwritten(self) -> frozenset[int]:
        """Blocks some report or some silent peer leaves possibly unwritten."""
        return self.blocks if self.every_block else frozenset(self.claimed)

    @property
    def all_gone(self) -> bool:
        return self.peers <= self.failed_peers | self.silent_peers


class PropertyMachine(RuleBasedStateMachine):
    GROUPS = 1

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.fence_ok = True
        self.tracker = LoadTracker(
            num_kv_cache_groups=self.GROUPS,
            clock=self.clock,
            fence=lambda _req: self.fence_ok,
            recent_ids_kept=RECENT_KEPT,
        )
        # No slack in the deadline heap, so a few loads are enough to see it leak.
        self.tracker._heap_slack = 0
        self.loads: dict[str, Truth] = {}
        self.step = 0
        #: The step of every id remembered as delivered (a re-tracked one's included: it
        #: filled the tracker's recent set until it was re-tracked).
        self.remember_steps: list[int] = []
        #: req_id -> the step it was last delivered, unless re-tracked since.
        self.remembered_at: dict[str, int] = {}
        self.ever_remembered: set[str] = set()
        self.largest_batch = 0
        self.delivered_failures = 0
        self.delivered_successes = 0
        self.notify_only_settled = 0
        self.fresh = itertools.count()

    # ------------------------------------------------------------------ the truth

    def _remember(self, req_ids: list[str]) -> None:
        for req in req_ids:
            self.remember_steps.append(self.step)
            self.remembered_at[req] = self.step
            self.ever_remembered.add(req)
        self.largest_batch = max(self.largest_batch, len(req_ids))

    def _after(self, req: str) -> int | None:
        """At most how many ids were remembered after ``req``'s last delivery (ids of the
        same step count as after it)."""
        at = self.remembered_at.get(req)
        if at is None:
            return None
        return sum(1 for s in self.remember_steps if s >= at) - 1

    def _settle(self, req: str, truth: Truth, peer: object) -> None:
        if truth.settled:
            return
        if peer is ALL_PEERS:
            truth.pending.clear()
        else:
            truth.pending.discard(peer)  # type: ignore[arg-type]
        truth.settled = not truth.pending
        if truth.settled and not truth.blocks:
            # Notify-only: settled is gone, never reported.
            del self.loads[req]
            self.notify_only_settled += 1
            self._remember([req])

    def _claim(self, truth: Truth, block_ids: list[int] | None) -> None:
        named = None if block_ids is None else truth.blocks & set(block_ids)
        if not named:
            truth.every_block = True
        else:
            truth.claimed |= named

    def _no_peers(self, req: str, truth: Truth) -> None:
        if truth.blocks:
            truth.failed = True
            truth.every_block = True
        self._settle(req, truth, ALL_PEERS)

    def _refused(self, req: str, accepted: bool, late_before: int, unknown_before: int) -> None:
        """A report for a load not in flight is dropped, and counted late while recent."""
        assert not accepted
        stats = self.tracker.stats()
        late = stats["late_reports"] - late_before
        unknown = stats["unknown_reports"] - unknown_before
        assert late + unknown == 1
        after = self._after(req)
        if req in self.loads:
            assert late == 1, f"{req} is settled, not yet delivered: late, not unknown"
        if after is not None and after <= RECENT_KEPT:
            assert late == 1, f"{req} was delivered {after} ids ago: late, not unknown"
        if req not in self.ever_remembered and req not in self.loads:
            assert unknown == 1, f"{req} was never tracked: unknown, not late"

    # ------------------------------------------------------------------ rules

    @rule(
        req=st.sampled_from(REQS),
        blocks=st.lists(BLOCK, max_size=4, unique=True),
        n_peers=st.integers(0, 3),
        as_list=st.booleans(),
        via_expect=st.booleans(),
        deadline=st.one_of(st.none(), st.floats(0.5, 5.0)),
    )
    def track(
        self,
        req: str,
        blocks: list[int],
        n_peers: int,
        as_list: bool,
        via_expect: bool,
        deadline: float | None,
    ) -> None:
        self.step += 1
        peers: int | list[int] = list(range(n_peers)) if as_list else n_peers
        first = [PLACEHOLDER] if via_expect else peers
        accepted = self.tracker.track(req, blocks, peers=first, deadline_s=deadline)
        assert accepted == (req not in self.loads)
        if not accepted:
            return
        self.remembered_at.pop(req, None)  # a re-load starts afresh
        at = None if deadline is None else self.clock.now + deadline
        truth = Truth(frozenset(blocks), frozenset(range(n_peers)), at, set(range(n_peers)))
        self.loads[req] = truth
        if via_expect:
            assert self.tracker.expect_peers(req, peers)
        if not n_peers:
            self._no_peers(req, truth)

    @rule(req=st.sampled_from(REQS + GHOSTS), n_peers=st.integers(0, 3))
    def expect(self, req: str, n_peers: int) -> None:
        """Peers named again later; refused once the load settled."""
        self.step += 1
        before = self.tracker.stats()
        accepted = self.tracker.expect_peers(req, n_peers)
        truth = self.loads.get(req)
        if truth is None or truth.settled:
            self._refused(req, accepted, before["late_reports"], before["unknown_reports"])
            return
        assert accepted
        truth.pending = set(range(n_peers))
        truth.peers = frozenset(range(n_peers))
        # New peer tasks: what the old ones did stays claimed, they have done nothing yet.
        truth.failed_peers.clear()
        truth.silent_peers.clear()
        if not n_peers:
            self._no_peers(req, truth)

    @rule(req=st.sampled_from(REQS + GHOSTS), peer=PEER)
    def succeed(self, req: str, peer: object) -> None:
        self.step += 1
        before = self.tracker.stats()
        accepted = self.tracker.succeeded(req, peer=peer)  # type: ignore[arg-type]
        truth = self.loads.get(req)
        if truth is None:
            self._refused(req, accepted, before["late_reports"], before["unknown_reports"])
            return
        assert accepted
        self._settle(req, truth, peer)

    @rule(
        req=st.sampled_from(REQS + GHOSTS),
        peer=PEER,
        narrowed=st.one_of(st.none(), st.lists(BLOCK, max_size=3)),
        settle=st.booleans(),
        stage=st.sampled_from(list(Stage)),
    )
    def fail(
        self, req: str, peer: object, narrowed: list[int] | None, settle: bool, stage: Stage
    ) -> None:
        self.step += 1
        before = self.tracker.stats()
        accepted = self.tracker.failed(
            req,
            stage,
            "x",
            peer=peer,  # type: ignore[arg-type]
            settle=settle,
            block_ids=narrowed,
        )
        truth = self.loads.get(req)
        if truth is None:
            self._refused(req, accepted, before["late_reports"], before["unknown_reports"])
            return
        assert accepted
        truth.failed = True
        if peer is ALL_PEERS:
            truth.failed_peers |= truth.pending
        elif peer in truth.peers:
            truth.failed_peers.add(peer)  # type: ignore[arg-type]
        self._claim(truth, narrowed)
        if settle:
            self._settle(req, truth, peer)

    @rule(
        n=st.integers(1, 8),
        how=st.sampled_from(["succeed", "fail", "abandon", "no_peers"]),
    )
    def notify_only_burst(self, n: int, how: str) -> None:
        """Many notify-only loads (the scheduler's empty-block pulls), each with a new id."""
        self.step += 1
        for _ in range(n):
            req = f"notify-{next(self.fresh)}"
            assert self.tracker.track(req, [], peers=0 if how == "no_peers" else 2)
            if how == "abandon":
                assert self.tracker.failed(req, Stage.PEER, "x", peer=ALL_PEERS)
            elif how != "no_peers":
                assert self.tracker.succeeded(req, peer=0)
                report = self.tracker.succeeded if how == "succeed" else self.tracker.failed
                kwargs = {} if how == "succeed" else {"stage": Stage.PEER, "reason": "x"}
                assert report(req, peer=1, **kwargs)  # type: ignore[operator]
            self.notify_only_settled += 1
            self._remember([req])

    @precondition(lambda self: bool(self.ever_remembered - set(self.loads)))
    @rule(data=st.data(), fail=st.booleans())
    def late_report(self, data: st.DataObject, fail: bool) -> None:
        """A report for an id delivered (or settled) some time ago."""
        self.step += 1
        req = data.draw(st.sampled_from(sorted(self.ever_remembered - set(self.loads))))
        before = self.tracker.stats()
        if fail:
            accepted = self.tracker.failed(req, Stage.TRANSFER, "late")
        else:
            accepted = self.tracker.succeeded(req)
        self._refused(req, accepted, before["late_reports"], before["unknown_reports"])

    @rule(seconds=st.floats(0.0, 3.0))
    def advance(self, seconds: float) -> None:
        self.step += 1
        self.clock.advance(seconds)

    @rule(ok=st.booleans())
    def set_fence(self, ok: bool) -> None:
        self.step += 1
        self.fence_ok = ok

    @rule()
    def drain(self) -> None:
        self.step += 1
        now = self.clock.now
        for req, truth in list(self.loads.items()):
            if truth.settled or truth.deadline is None or truth.deadline > now:
                continue
            # Silent past the deadline: a pending peer may have written nothing.
            truth.silent_peers |= truth.pending
            truth.every_block = True
            truth.failed = True
            if self.fence_ok:
                self._settle(req, truth, ALL_PEERS)
        ready = {r: t for r, t in self.loads.items() if t.settled}
        report = self.tracker.drain()
        assert set(report.finished_recving) == set(ready)
        failed = {r for r, _ in report.failures}
        for req, truth in ready.items():
            self.check_coverage(req, truth, report.invalid_block_ids, report.failed_recving)
            self.check_all_gone_is_never_a_success(req, truth, failed)
            assert (req in failed) == truth.failed
            self.delivered_failures += truth.failed
            self.delivered_successes += not truth.failed
            del self.loads[req]
        if ready:
            self._remember(list(ready))

    # ------------------------------------------------------------------ the rules

    def check_coverage(
        self, req: str, truth: Truth, invalid: frozenset[int] | set[int], by_id: object
    ) -> None:
        """A delivered failure covers every block any report or silent peer left unwritten."""
        if not truth.unwritten:
            return
        if self.GROUPS == 1:
            missing = truth.unwritten - set(invalid)
            assert not missing, f"{req}: blocks {sorted(missing)} left unwritten, not reported"
        else:
            assert req in by_id, f"{req}: failed, not named in failed_recving"  # type: ignore[operator]

    def check_all_gone_is_never_a_success(self, req: str, truth: Truth, failed: set[str]) -> None:
        """A load whose peers all failed or went silent (or that had none) is a failure."""
        if truth.all_gone:
            assert req in failed, f"{req}: every peer gone, delivered as a success"

    @invariant()
    def memory_is_bounded_by_in_flight_loads(self) -> None:
        t = self.tracker
        assert set(t._loads) == set(self.loads)
        assert len(t._ready) <= len(t._loads)
        assert len(t._deadlines) <= 2 * len(t._loads) + t._heap_slack
        # Two generations, each at most RECENT_KEPT ids or one drain's deliveries.
        assert len(t._recent) + len(t._recent_old) <= 2 * max(RECENT_KEPT, self.largest_batch)
        for req, load in t._loads.items():
            truth = self.loads[req]
            assert load.pending <= set(truth.peers) | {PLACEHOLDER}
            assert load.failed_blocks is None or load.failed_blocks <= set(load.flat)
        stats = t.stats()
        assert set(+stats.events) <= set(EVENT_COUNTERS)
        assert set(+stats.failed_by_stage) <= set(StageEnum)

    @invariant()
    def stats_match_what_is_reported(self) -> None:
        """Failures are counted for loads that are (or will be) reported, nothing else."""
        stats = self.tracker.stats()
        in_flight_failed = sum(1 for t in self.loads.values() if t.failed and t.blocks)
        assert stats["loads_failed"] == self.delivered_failures + in_flight_failed
        assert sum(stats.failed_by_stage.values()) == stats["loads_failed"]
        assert stats["loads_succeeded"] == self.delivered_successes
        assert stats["empty_loads"] == self.notify_only_settled


class HmaPropertyMachine(PropertyMachine):
    """Two KV-cache groups: a failure is named by request id, never by block."""

    GROUPS = 2


TestProperties = PropertyMachine.TestCase
TestHmaProperties = HmaPropertyMachine.TestCase


@pytest.fixture(autouse=True)
def _quiet(quiet_kvfail_logs: None) -> None:
    """Random runs fail many loads; their log lines are not under test here."""
