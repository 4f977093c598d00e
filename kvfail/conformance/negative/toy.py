"""Negative controls on the toy: the toy connector broken in exactly ONE way each.

Each class is :class:`~kvfail.harness.toy.ToyConnector` (a test double) with one contract
rule broken, the way real connectors broke it upstream; fast, they test the suite's
oracles in isolation. ``conformance/selftest`` runs the suite against each and asserts
it is flagged where :data:`EXPECTED_FLAGS` says, while the unbroken toy passes.

=========================  ===========================================  =======  =========
class                      what is broken                               clause   flagged by
=========================  ===========================================  =======  =========
``SwallowsFailure``        a failed load is only logged, never reported C1/C2    stall
                           (pre-#50984 Mooncake): the request waits
``ReportsLate``            failures are reported one pass after the id  C3       late
                           was reported in ``finished_recving``
``ReportsUnknownId``       a failure also reports an id the scheduler   C7       crash
                           never tracked (stale/duplicate notification)
``ReportsSuccessOnFailure``a failed transfer is reported as a plain     C1       unreported
                           success with wrong bytes (the HF3FS pattern)
``ReportsOneFailurePerStep``when several loads fail in one step, only the C1/C2    stall
                           first is reported; the others wait forever
``NoFailureChannel``       no failure channel at all: a failed load is  C1       unreported
                           reported as a plain completion (not skipped)
``ReportsFewerBlocks``     a failure names one block where none arrived C1       wrong KV
                           (``recompute`` runs on unwritten blocks)
``WritesAfterRelease``     fails fast without a fence; the transfer     C11      integrity
                           writes after the blocks were released
``FailsBeforeDeadline``    declares a 3 s deadline, but its watchdog    C10      early
                           fails any load unanswered after one step
``FailsEveryPeerOnLoss``   when one peer is lost, fails every load in   C8       false
                           flight, the live peers' too                           failure
``FreesWhileWriting``      fails an overdue load at its deadline and    C11      integrity
                           frees its blocks at once, though a slow P            or leak
                           still writes into them (no quarantine)
``FailsOnlyOnRankZero``    only TP rank 0 reports a failure; another    C1       wrong KV
                           rank's failed load goes out as a success             (TP 2)
``ReportsBlocksWithTwoGroups`` failures go by block id with two       C5       crash
                           KV-cache groups (never ``failed_recving``)
``ReAdvertisesFailedHit``  answers the next lookup after a failed load  C12      reload
                           with the same hit (vLLM #55297)                      loop
``ReportsFailureTwice``    reports a failure again one pass later,      C7       crash
                           when the scheduler has let the id go
``FailsPastDeadline``      declares a 1 s deadline, its watchdog        C10      late
                           enforces one past the suite's margin
``WritesAfterReleaseOnRankOne`` rank 1 fails fast unfenced, its        C11      integrity
                           transfer writes into released blocks                 (TP 2)
=========================  ===========================================  =======  =========

``ReportsOneFailurePerStep`` is toy-only, and flagged by a concurrency scenario
(``kvfail/conformance/scenarios/test_concurrency.py``), and by the soak
(``test_concurrency_soak.py`` beside it, :data:`EXTRA_FLAGS`): with one load in flight it
is indistinguishable from a working connector, which is why those scenarios exist.
``FailsBeforeDeadline`` is flagged by the slow-peer scenario of ``test_concurrency.py``: a
peer that answers at once, or never, does not show it.
``FailsEveryPeerOnLoss`` is flagged by the two-P scenario there: with one peer, all loads in
flight are that peer's. ``FreesWhileWriting`` is flagged by
``kvfail/conformance/scenarios/test_quarantine.py``: only a P that writes after the
deadline, into blocks other requests were given, shows it. ``FailsOnlyOnRankZero`` shows
only at TP 2 with rank 1 faulted (:data:`EXPECTED_FLAGS_TP2`): it passes every TP 1
scenario and the fault on rank 0, which is why the one-rank fault runs for each rank.
``WritesAfterReleaseOnRankOne`` shows there too, and only through the integrity oracle's
watch of rank 1's KV: its rank 0 fences, so rank 0's blocks hold nothing late.
``ReportsBlocksWithTwoGroups`` shows only where D has two KV-cache groups, and
``ReAdvertisesFailedHit`` only under ``recompute`` (under ``fail`` the request ends with
its failure and is never looked up again), where a whole load failed: after a failure of
one block of several the rewound request has less than a block left to look up.
``ReportsFailureTwice`` is flagged where a load fails and where an aborted load fails
(``test_failure_races_abort``, ``test_abort_while_waiting``; each serves one more
request after the free, the step in which the repeat lands), and ``FailsPastDeadline``
by both scenarios whose peer never answers.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvfail.compat import KVConnectorTransferResults, base_method
from kvfail.conformance.negative.flag import Flag
from kvfail.harness.toy import ToyConnector
from kvfail.load_records import StepReport
from kvfail.stages import Stage

__all__ = [
    "EXPECTED_FLAGS",
    "EXPECTED_FLAGS_TP2",
    "EXTRA_FLAGS",
    "PASSES_TP2",
    "FailsBeforeDeadline",
    "FailsEveryPeerOnLoss",
    "FailsOnlyOnRankZero",
    "FailsPastDeadline",
    "FreesWhileWriting",
    "NoFailureChannel",
    "ReAdvertisesFailedHit",
    "ReportsBlocksWithTwoGroups",
    "ReportsFailureTwice",
    "ReportsFewerBlocks",
    "ReportsLate",
    "ReportsOneFailurePerStep",
    "ReportsSuccessOnFailure",
    "ReportsUnknownId",
    "SwallowsFailure",
    "WritesAfterRelease",
    "WritesAfterReleaseOnRankOne",
]

log = logging.getLogger("kvfail.conformance.negative")


class SwallowsFailure(ToyConnector):
    """Logs a failed load and drops it: no ``finished_recving``, so the request stalls."""

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **kwargs: Any) -> bool:
        log.warning("load %s failed (%s): %s", req_id, stage, reason)  # and nothing else
        return True


class ReportsLate(ToyConnector):
    """Reports ``finished_recving`` on time but holds the failure back one pass (C3)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late_blocks: set[int] = set()
        self._late_ids: set[str] = set()
        self._held_blocks: set[int] = set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        late, self._late_ids = self._late_ids, set(results.failed_recving)
        results.failed_recving = late
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        now = super().get_block_ids_with_load_errors()
        late, self._held_blocks = self._held_blocks, set(now)
        return late


class ReportsUnknownId(ToyConnector):
    """Whenever it reports a failure, also reports a retry id the scheduler never saw."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self._kvfail_invalid or results.failed_recving:
            failed = set(results.failed_recving) or set(results.finished_recving)
            results.finished_recving |= {f"{rid}-retry" for rid in failed}
        return results


class ReportsSuccessOnFailure(ToyConnector):
    """A failed transfer is reported as success; D's blocks keep whatever was there."""

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **kwargs: Any) -> bool:
        self._inflight.pop(req_id, None)  # no bytes are copied
        return self.load_succeeded(req_id)


class ReportsOneFailurePerStep(ToyConnector):
    """Keeps one failure slot per step: when several loads fail in the same drain, only
    the first is reported; the others are dropped (neither failed nor finished), so their
    requests wait for remote KV forever with their blocks held (C1/C2). A connector that
    records "the" failed request of a step, or fails only the first request of a batch
    when its peer dies, breaks this way; one failing load at a time never shows it."""

    def drain_step(self) -> StepReport:
        report = self.failure_reporter.drain()
        lost = {rid for rid, _ in report.failures[1:]}
        if lost:
            lost_blocks = {b for rid in lost for g in self._inflight[rid].block_ids for b in g}
            report = StepReport(
                report.finished_recving - lost,
                report.failed_recving - lost,
                report.invalid_block_ids - lost_blocks,
                report.failures[:1],
            )
        if report.invalid_block_ids:
            self._kvfail_invalid.update(report.invalid_block_ids)
        return report


class NoFailureChannel(ToyConnector):
    """Has no way to report a failed load: only the pre-contract ``get_finished``, so a
    failure goes out as a plain completion. Its class overrides neither
    ``get_transfer_results`` nor ``get_block_ids_with_load_errors`` (both are the base's),
    so it has no failure channel by introspection; the failed-load scenarios must still
    run for it and fail (reporting a failed load is a MUST), never be skipped."""

    get_transfer_results = base_method("get_transfer_results")
    get_block_ids_with_load_errors = KVConnectorBase_V1.get_block_ids_with_load_errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = ToyConnector.get_transfer_results(self, finished_req_ids)
        ToyConnector.get_block_ids_with_load_errors(self)  # drained, and dropped
        done = results.finished_recving | results.failed_recving
        return set(results.finished_sending), set(done)


class ReportsFewerBlocks(ToyConnector):
    """Names fewer blocks than are missing: a transfer that delivered nothing is reported
    as a failure of one block, so under ``recompute`` the scheduler keeps the blocks
    before it as computed and runs on bytes nobody wrote (C1, wrong KV). Under ``fail``
    the request ends in an error and nothing runs on them."""

    def fail(
        self,
        req_id: str,
        *,
        stage: Stage = Stage.TRANSFER,
        reason: str = "toy: commanded failure",
        block_index: int | None = None,
    ) -> bool:
        load = self._inflight.get(req_id)
        if load is None:
            return False
        named = load.block_ids[0][-1 if block_index is None else block_index]
        return self.load_failed(req_id, stage, reason, block_ids=[named])  # nothing delivered


class WritesAfterRelease(ToyConnector):
    """Fails fast without a fence: a failed load is reported at once, but its transfer
    goes on and writes P's bytes into the load's blocks two drains later, when the
    scheduler has released them (``fail``) or D has recomputed into them (``recompute``).
    The integrity oracle names the write (C11); no report-level check can see it."""

    #: Drains between the failure report and the late write.
    LATE_DRAINS = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late: list[list[Any]] = []

    def fail(self, req_id: str, **kwargs: Any) -> bool:
        load = self._inflight.get(req_id)
        if load is not None:
            self._late.append([self.LATE_DRAINS, load])
        return super().fail(req_id, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for entry in self._late:
            entry[0] -= 1
            if entry[0] == 0:
                self._deliver(entry[1])
        self._late = [e for e in self._late if e[0] > 0]
        return super().get_transfer_results(finished_req_ids)


class FailsBeforeDeadline(ToyConnector):
    """Declares a load deadline of :attr:`DECLARED_S`, but its watchdog fails every load
    still unanswered at its second drain (one step after the load started): a slow but
    live peer's load is failed long before the deadline the suite judges by (C10). A
    connector whose watchdog counts steps, or mixes up units, breaks this way; a peer
    that answers within a step, or never, does not show it."""

    DECLARED_S = 3.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_load_deadline_s = self.DECLARED_S
        #: Drains each unanswered load has been through.
        self._drains: dict[str, int] = {}

    def complete(self, req_id: str) -> bool:
        self._drains.pop(req_id, None)
        return super().complete(req_id)

    def fail(self, req_id: str, **kwargs: Any) -> bool:
        self._drains.pop(req_id, None)
        return super().fail(req_id, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for req_id in list(self._inflight):
            drains = self._drains[req_id] = self._drains.get(req_id, 0) + 1
            if drains == 2:
                self.load_failed(req_id, Stage.WATCHDOG, "no result after one step")
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving:
            self._drains.pop(req_id, None)
        return results


class FailsEveryPeerOnLoss(ToyConnector):
    """When a load fails because its peer is gone (stage ``peer_lost``), fails every load
    in flight, from every peer: the live peers' loads are reported failed although their
    bytes arrive (C8), and under ``fail`` their requests end in an error. A connector
    whose peer-death handler tears down its one transfer engine, or walks "all pending
    transfers" instead of the dead peer's, breaks this way; with one peer every load in
    flight is that peer's, so only D loading from two peers at once shows it."""

    def fail(
        self,
        req_id: str,
        *,
        stage: Stage = Stage.TRANSFER,
        reason: str = "toy: commanded failure",
        block_index: int | None = None,
    ) -> bool:
        if stage is not Stage.PEER_LOST:
            return super().fail(req_id, stage=stage, reason=reason, block_index=block_index)
        failed = False
        for other in sorted(self.inflight()):  # the dead peer's and everyone else's
            failed |= super().fail(other, stage=stage, reason=reason)
        return failed


class FreesWhileWriting(ToyConnector):
    """Fails fast WITHOUT quarantine: its watchdog fails an overdue load at the deadline
    and says the transfer is fenced, so the tracker delivers the failure and the
    scheduler frees the blocks at once, while the slow P's transfer still writes into
    them (the suite's ``slow_peer_past_deadline``: the toy transport writes after the
    request was let go). A connector that cancels only its own side of a push (Mooncake:
    D closes its socket, P still writes into D's memory) or whose READ completes after
    its handle was given up breaks this way; the blocks reach other requests, which then
    run on the late bytes (C11, the integrity oracle), and nothing can tell the scheduler."""

    def kvfail_fence(self, req_id: str) -> bool:
        return True  # "fenced", whatever the transfer may still do


class ReportsBlocksWithTwoGroups(ToyConnector):
    """Reports every failure by block id, whatever the number of KV-cache groups: the
    request-level channel is never used. With one group that is the contract; with two,
    a flat set of block ids cannot say which group it means, and vLLM's scheduler raises
    ``RuntimeError`` inside the engine core (C5). Connectors written before the
    request-level channel existed break this way the day they serve a hybrid model."""

    def drain_step(self) -> StepReport:
        report = super().drain_step()
        if not report.failed_recving:
            return report
        blocks = {
            b
            for rid in report.failed_recving
            for group in self._inflight[rid].block_ids
            for b in group
        }
        self._kvfail_invalid.update(blocks)
        return StepReport(
            report.finished_recving,
            frozenset(),
            report.invalid_block_ids | blocks,
            report.failures,
        )


class ReAdvertisesFailedHit(ToyConnector):
    """After a load failed, answers the request's next lookup with the same hit: under
    ``recompute`` the scheduler rewinds the request, asks again, and the request goes
    back to waiting for the KV that just failed (C12, vLLM #55297's load-fail-reload
    loop). Under ``fail`` the request ends with its failure, so nothing shows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.readvertise = True


class ReportsFailureTwice(ToyConnector):
    """Reports each failed load correctly, then once more one pass later, as a connector
    whose transfer thread and watchdog both report the same failure does. By then the
    scheduler has let the request go (an aborted request is freed at its first
    ``finished_recving``, a failed one has ended), so the repeat names an id the
    scheduler no longer tracks (C7), which vLLM meets with an assertion in its engine
    core. One failure in flight at a time shows it as well as many."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._failed: set[str] = set()
        self._repeat: set[str] = set()

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **kwargs: Any) -> bool:
        self._failed.add(req_id)
        return super().load_failed(req_id, stage, reason, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        repeat, self._repeat = self._repeat, results.finished_recving & self._failed
        self._failed -= self._repeat
        results.finished_recving |= repeat
        if self.num_groups > 1:
            results.failed_recving |= repeat
        return results


class FailsPastDeadline(ToyConnector):
    """Declares a load deadline of :attr:`DECLARED_S`, but its watchdog enforces a later
    one: past the declared deadline plus the suite's margin, yet inside the suite's wait,
    so the load is reported and only its lateness is wrong (C10 past deadline). A
    connector that declares one setting and arms its watchdog from another (or restarts
    a load's timer at each retry) breaks this way. The enforced deadline is taken in the
    suite's time scale, so that on a loaded machine it still lands in that window."""

    DECLARED_S = 1.0
    #: How far past the declared deadline the watchdog fires, on an idle machine: beyond
    #: the suite's margin (3 s for this deadline), within its wait (5 s in all).
    LATE_BY_S = 3.5

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.kv_load_deadline_s = self.DECLARED_S
        if role == KVConnectorRole.WORKER:
            from kvfail.conformance import timebase

            enforced = self.DECLARED_S + timebase.scaled(self.LATE_BY_S)
            self.failure_reporter.default_deadline_s = enforced


#: Per D engine (its engine id): how many WORKER-role instances were built, in rank order.
_WORKERS_BUILT: dict[str, int] = {}


class _KnowsItsRank(ToyConnector):
    """Learns its TP rank the way a connector without a rank argument could: the harness
    builds an engine's simulated ranks in rank order, so the n-th WORKER of an engine id
    is its rank n. A base for controls broken on some ranks only."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._tp_rank = _WORKERS_BUILT.get(self.engine_id, 0)
        if role == KVConnectorRole.WORKER:
            _WORKERS_BUILT[self.engine_id] = self._tp_rank + 1


class FailsOnlyOnRankZero(_KnowsItsRank, ReportsSuccessOnFailure):
    """Reports a failed load only on TP rank 0: a failure another rank finds is reported
    as a plain completion, as by a connector whose failure bookkeeping lives with rank 0
    (the rank that handshakes for the others, or the one whose output a reader takes as
    the engine's). With rank 0 faulted it passes; with rank 1 faulted the request is
    "loaded" with blocks rank 1 never received (C1, wrong KV under ``recompute``, an
    unreported failure under ``fail``)."""

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **kwargs: Any) -> bool:
        if self._tp_rank == 0:
            return ToyConnector.load_failed(self, req_id, stage, reason, **kwargs)
        return super().load_failed(req_id, stage, reason, **kwargs)  # reported as a success


class WritesAfterReleaseOnRankOne(_KnowsItsRank, WritesAfterRelease):
    """Rank 0 fences its failed loads; TP rank 1 fails fast without a fence, and its
    transfer writes into the load's blocks after the scheduler released them (C11). A
    connector that cancels its transfers on the rank that reports (rank 0) and not on
    the others breaks this way. Only the freed-block watch of every rank's KV shows it:
    at TP 1 it is a working connector."""

    def fail(self, req_id: str, **kwargs: Any) -> bool:
        if self._tp_rank == 0:
            return ToyConnector.fail(self, req_id, **kwargs)
        return super().fail(req_id, **kwargs)


EXPECTED_FLAGS: dict[str, Flag] = {
    "SwallowsFailure": Flag("test_failed_load_one_group", "C2/C10 liveness"),
    "ReportsLate": Flag("test_failed_load_one_group", "C3 late"),
    "ReportsUnknownId": Flag("test_failed_load_one_group", "C7 crash"),
    "ReportsSuccessOnFailure": Flag("test_failed_load_one_group", "C1 unreported"),
    "ReportsOneFailurePerStep": Flag("test_many_loads_fail_in_one_step", "C2/C10 liveness"),
    "NoFailureChannel": Flag("test_failed_load_one_group", "C1 unreported"),
    "ReportsFewerBlocks": Flag(
        "test_failed_load_one_group", "C1 wrong KV", frozenset({"recompute"})
    ),
    "WritesAfterRelease": Flag("test_failures_and_successes_same_step", "C11 "),
    "FailsBeforeDeadline": Flag("test_slow_peer_not_failed_before_deadline", "C10 early failure"),
    "FailsEveryPeerOnLoss": Flag("test_two_peers_one_killed", "C8 false failure"),
    "FreesWhileWriting": Flag("test_slow_peer_writes_after_deadline", "C11 "),
    "ReportsBlocksWithTwoGroups": Flag("test_failed_load_request_level_two_groups", "C5"),
    "ReAdvertisesFailedHit": Flag(
        "test_failed_load_request_level_two_groups", "C12 (#55297)", frozenset({"recompute"})
    ),
    "ReportsFailureTwice": Flag("test_failed_load_one_group", "C7 "),
    "FailsPastDeadline": Flag("test_silent_peer_caught_by_deadline", "C10 past deadline"),
}

#: Further scenarios that must flag a control besides its :data:`EXPECTED_FLAGS` one: the
#: soak sums its oracles over every request, so a control that loses concurrent failures
#: must be caught there too, not only by the scenario built for it.
EXTRA_FLAGS: dict[str, tuple[Flag, ...]] = {
    "ReportsOneFailurePerStep": (Flag("test_soak_random_faults", "C2/C10 liveness"),),
    "ReportsFailureTwice": (
        Flag("test_failure_races_abort", "C7 "),
        Flag("test_abort_while_waiting", "C7 "),
    ),
    "ReAdvertisesFailedHit": (
        Flag("test_silent_peer_caught_by_deadline", "C12 (#55297)", frozenset({"recompute"})),
    ),
    "FailsPastDeadline": (Flag("test_frozen_peer_caught_by_deadline", "C10 past deadline"),),
}

#: The flags that show only at TP 2 (``--layout tp2``): a one-rank fault, each rank in
#: turn, alone and under many loads. ``FailsOnlyOnRankZero`` is built for them (it passes
#: every TP 1 scenario); ``ReportsOneFailurePerStep`` must be caught where the failures of
#: many loads come from one dead rank, too.
EXPECTED_FLAGS_TP2: dict[str, tuple[Flag, ...]] = {
    "FailsOnlyOnRankZero": (
        Flag("test_tp2_failure_on_one_rank_1", "C1 wrong KV"),
        Flag("test_many_loads_one_rank_killed", "C1 wrong KV"),
    ),
    "ReportsOneFailurePerStep": (
        Flag("test_many_loads_one_rank_killed", "C2/C10 liveness"),
        Flag("test_many_loads_one_rank_frozen", "C2/C10 liveness"),
    ),
    "WritesAfterReleaseOnRankOne": (
        Flag("test_tp2_failure_on_one_rank_1", "C11 "),
        Flag("test_failures_and_successes_same_step", "C11 "),
    ),
}
#: What a TP 2 control must still pass there: a fault on rank 0 shows nothing of a
#: breakage on the other ranks, and the basics hold.
PASSES_TP2: dict[str, tuple[str, ...]] = {
    "FailsOnlyOnRankZero": (
        "test_tp2_failure_on_one_rank_0",
        "test_successful_load",
        "test_local_request_untouched",
    ),
    "WritesAfterReleaseOnRankOne": (
        "test_tp2_failure_on_one_rank_0",
        "test_successful_load",
        "test_local_request_untouched",
    ),
}
