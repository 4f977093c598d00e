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

:class:`QuarantineMachine` drives the quarantine across D's TP x PP workers as vLLM steps
them (hold, fence part of the ranks or stages, fence all, a fence answering False,
release) and checks that no block a writer may still reach is ever free, and that every
hold ends once the writes are over. With holds keyed by TP rank alone it finds a block
freed while another stage may still write.

``HYPOTHESIS_PROFILE=slow`` runs many more examples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfail import ALL_PEERS, FailureReporterMixin, Stage
from kvfail.stages import Stage as StageEnum
from kvfail.stats import EVENT_COUNTERS
from tests.core.fakes import ManualClock
from tests.core.machines import TrackerStateMachine

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


class PropertyMachine(TrackerStateMachine):
    def __init__(self) -> None:
        super().__init__(recent_ids_kept=RECENT_KEPT)
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


class _Block:
    """A block of the model pool: only its reference count matters here."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0


class _Pool:
    """What :class:`BlockQuarantine` needs of vLLM's ``BlockPool``."""

    def touch(self, blocks: list[_Block]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[_Block]) -> None:
        for b in blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} freed twice"
            b.ref_cnt -= 1


class _Worker(FailureReporterMixin):
    """A worker whose fence is the machine's ground truth: True only when its write
    is over (and the fence is not told to refuse)."""

    def __init__(self, fence: Callable[[str], bool]) -> None:
        self._truth = fence

    def kvfail_fence(self, req_id: str) -> bool:
        return self._truth(req_id)


#: D's workers: TP 2 x PP 2, each named as the connectors name it in holds.
WORKERS = [(tp, pp) for pp in range(2) for tp in range(2)]
Q_DEADLINE_S = 1.0


class QuarantineMachine(RuleBasedStateMachine):
    """D's TP x PP workers, each with its own tracker and quarantine, and the scheduler
    side's :class:`BlockQuarantine` over a model pool, stepped as vLLM steps them:
    every worker drains, their notices are merged, applied, and a request every worker
    delivered is freed by the scheduler.

    Ground truth: which (worker, request) transfers may still write. Safety, after every
    rule: no block such a transfer may write has reference count 0 (it would be handed
    to another request). Liveness (:meth:`everything_ends`): once every write is over
    and the fences answer True, every hold ends and every block is free.
    """

    def __init__(self) -> None:
        super().__init__()
        from kvfail.quarantine import BlockQuarantine, hold_rank

        self.clock = ManualClock()
        self.writing: set[tuple[int, str]] = set()
        #: Failed unfenced: by the tracker's contract only ``load_fenced`` ends its hold
        #: (the connector's proof); the fence covers loads the watchdog held.
        self.unfenced: set[tuple[int, str]] = set()
        self.fence_ok = [True] * len(WORKERS)
        self.workers = []
        for i, (tp, pp) in enumerate(WORKERS):
            w = _Worker(lambda req, i=i: self.fence_ok[i] and (i, req) not in self.writing)
            w.init_failure_reporter(
                num_kv_cache_groups=1,
                request_level_channel=True,
                quarantine=True,
                clock=self.clock,
                default_deadline_s=Q_DEADLINE_S,
                fence_retry_s=0.1,
                rank=hold_rank(tp, 2, pp),
            )
            self.workers.append(w)
        self.blocks: dict[str, list[_Block]] = {}
        self.scheduled: set[str] = set()  # the scheduler still has the request
        self.delivered: dict[str, set[int]] = {}
        self.quarantine = BlockQuarantine(
            _Pool(), lambda r: self.blocks.get(r) if r in self.scheduled else None
        )
        self.ids = itertools.count()
        self.next_block = itertools.count()

    def _live(self, data: st.DataObject) -> tuple[int, str] | None:
        live = sorted(
            (i, r)
            for i, w in enumerate(self.workers)
            for r in self.scheduled
            if w.failure_reporter.is_tracked(r)
        )
        return data.draw(st.sampled_from(live)) if live else None

    @rule()
    def start(self) -> None:
        req = f"q-{next(self.ids)}"
        blocks = [_Block(next(self.next_block)) for _ in range(2)]
        for b in blocks:
            b.ref_cnt = 1  # the request's own reference
        self.blocks[req] = blocks
        self.scheduled.add(req)
        self.delivered[req] = set()
        for i, w in enumerate(self.workers):
            assert w.track_load(req, [b.block_id for b in blocks])
            self.writing.add((i, req))

    @rule(data=st.data())
    def succeed(self, data: st.DataObject) -> None:
        picked = self._live(data)
        if picked is not None:
            self.writing.discard(picked)
            self.workers[picked[0]].load_succeeded(picked[1])
            self._proven(picked)  # a late success of a held load ends its write too

    @rule(data=st.data(), fenced=st.booleans())
    def fail(self, data: st.DataObject, fenced: bool) -> None:
        """A failure; unfenced: the transfer may keep writing (a push P, a READ). A later
        fenced report proves nothing about an earlier unfenced one (a failure is fenced by
        default, whoever reports it): only ``load_fenced`` ends that write."""
        picked = self._live(data)
        if picked is None:
            return
        if fenced:
            if picked not in self.unfenced:
                self.writing.discard(picked)
        else:
            # The connector says the transfer may still write, whatever came before.
            self.writing.add(picked)
            self.unfenced.add(picked)
        self.workers[picked[0]].load_failed(picked[1], Stage.TRANSFER, "x", fenced=fenced)

    @rule(data=st.data())
    def writes_end(self, data: st.DataObject) -> None:
        """A transfer's writes are proven over: a load failed unfenced is told so
        (``load_fenced``, the connector's proof); any other is left for the fence to
        find at its next try."""
        if not self.writing:
            return
        picked = data.draw(st.sampled_from(sorted(self.writing)))
        self.writing.discard(picked)
        self._proven(picked)

    def _proven(self, picked: tuple[int, str]) -> None:
        if picked in self.unfenced:
            self.unfenced.discard(picked)
            i, req = picked
            tracker = self.workers[i].failure_reporter
            if tracker.is_quarantined(req) or tracker.is_tracked(req):
                self.workers[i].load_fenced(req)

    @rule(worker=st.integers(0, len(WORKERS) - 1), ok=st.booleans())
    def fence_answers(self, worker: int, ok: bool) -> None:
        """False: a fence that cannot prove the write over (a release refused)."""
        self.fence_ok[worker] = ok

    @rule(seconds=st.floats(0.0, 2.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def step(self) -> None:
        from kvfail.quarantine import QuarantineNotice

        merged = QuarantineNotice()
        finished: list[tuple[int, frozenset[str]]] = []
        for i, w in enumerate(self.workers):
            report = w.drain_step()
            finished.append((i, frozenset(report.finished_recving)))
            merged.merge(w.take_quarantine_notice())
        self.quarantine.apply(merged)  # before vLLM frees what the step finished
        for i, done in finished:
            for req in done:
                self.delivered[req].add(i)
                if len(self.delivered[req]) == len(self.workers) and req in self.scheduled:
                    self.scheduled.discard(req)
                    for b in self.blocks[req]:
                        b.ref_cnt -= 1

    @invariant()
    def no_block_a_writer_may_reach_is_free(self) -> None:
        for i, req in self.writing:
            for b in self.blocks[req]:
                assert b.ref_cnt > 0, f"{req}'s block {b.block_id} free while worker {i} may write"

    @rule()
    def everything_ends(self) -> None:
        """Every write over, every fence True: within a few deadlines of steps every
        load is delivered, every hold released and every block free."""
        for picked in sorted(self.writing):
            self.writing.discard(picked)
            self._proven(picked)
        self.fence_ok = [True] * len(WORKERS)
        for _ in range(6):
            self.clock.advance(Q_DEADLINE_S)
            self.step()
        assert not self.scheduled and len(self.quarantine) == 0
        assert all(b.ref_cnt == 0 for blocks in self.blocks.values() for b in blocks)
        assert all(len(w.failure_reporter) == 0 for w in self.workers)


TestProperties = PropertyMachine.TestCase
TestHmaProperties = HmaPropertyMachine.TestCase
TestQuarantineProperties = QuarantineMachine.TestCase


@pytest.fixture(autouse=True)
def _quiet(quiet_kvfail_logs: None) -> None:
    """Random runs fail many loads; their log lines are not under test here."""
