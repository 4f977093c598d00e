"""Negative controls: connectors broken in exactly ONE way, that the suite must flag.

Why: a conformance suite that passes every connector proves nothing. Each class below is
a working connector with one contract rule broken, the way real connectors broke it
upstream; ``conformance/selftest`` runs the suite against each
(``--connector kvfail.conformance.negative:<Class>``) and asserts it is flagged by the
right scenario for the right clause, while the unbroken connector passes.

Two sets:

* on the toy (:class:`~kvfail.harness.toy.ToyConnector`, a test double): every breakage in
  the table below (:data:`EXPECTED_FLAGS`); fast, they test the suite's oracles in
  isolation;
* on the REAL connector (``*Mooncake``: :class:`connectors.mooncake.KvfailMooncakeConnector`
  with its worker broken in one method), the breakages of the first rows again (a swallowed
  failure, a late report, an unknown id, a success on failure; :data:`EXPECTED_FLAGS_REAL`),
  driven by the real Mooncake driver, so the real
  P process and TCP transport provoke the fault (P answers the pull with an ERROR reply)
  and the real scheduler sees the result. Defined only where the Mooncake connector can
  be imported (:data:`EXPECTED_FLAGS_REAL` is empty otherwise).

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
=========================  ===========================================  =======  =========

One store control, on vLLM's ExampleConnector (real files on disk, ``ExampleDriver``):
``SkipsStoreLoad`` matches the stored prefix but never loads it, and reports nothing; the
integrity oracle flags it in ``test_store_load_ok`` (C1 wrong KV), where the unbroken
ExampleConnector passes (``conformance/selftest/test_store_controls.py``). Another, on
kvfail's own Example connector (``connectors/example``): ``SkipsDigestCheck`` loads each
file without checking the digest its save path wrote; ``test_store_data_overwritten``
flags it (C1 wrong KV), where ``KvfailExampleConnector`` passes. ``DropsChildErrors`` is
vLLM's MultiConnector over two of them that drops its children's reports;
``test_store_all_children_damaged`` flags it, where the ``multi-example`` driver's
MultiConnector passes.

``ReportsOneFailurePerStep`` is toy-only, and flagged by a concurrency scenario
(``kvfail/conformance/scenarios/test_concurrency.py``), and by its soak
(:data:`EXTRA_FLAGS`): with one load in flight it is indistinguishable from a working
connector, which is why those scenarios exist. ``FailsBeforeDeadline`` is flagged by the
slow-peer scenario there: a peer that answers at once, or never, does not show it.
``FailsEveryPeerOnLoss`` is flagged by the two-P scenario there: with one peer, all loads in
flight are that peer's. ``FreesWhileWriting`` is flagged by
``kvfail/conformance/scenarios/test_quarantine.py``: only a P that writes after the
deadline, into blocks other requests were given, shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from kvfail.compat import KVConnectorTransferResults, base_method
from kvfail.harness.toy import ToyConnector
from kvfail.stages import Stage
from kvfail.tracker import StepReport

__all__ = [
    "EXPECTED_FLAGS",
    "EXPECTED_FLAGS_REAL",
    "EXTRA_FLAGS",
    "FailsBeforeDeadline",
    "FailsEveryPeerOnLoss",
    "Flag",
    "FreesWhileWriting",
    "NoFailureChannel",
    "ReportsFewerBlocks",
    "ReportsLate",
    "ReportsOneFailurePerStep",
    "ReportsSuccessOnFailure",
    "ReportsUnknownId",
    "SwallowsFailure",
    "WritesAfterRelease",
    "flags",
]

log = logging.getLogger("kvfail.conformance.negative")


class SwallowsFailure(ToyConnector):
    """Logs a failed load and drops it: no ``finished_recving``, so the request stalls."""

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
    ) -> bool:
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

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
    ) -> bool:
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

    def fail(
        self,
        req_id: str,
        *,
        stage: Stage = Stage.TRANSFER,
        reason: str = "toy: commanded failure",
        block_index: int | None = None,
    ) -> bool:
        load = self._inflight.get(req_id)
        if load is not None:
            self._late.append([self.LATE_DRAINS, load])
        return super().fail(req_id, stage=stage, reason=reason, block_index=block_index)

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


class Flag(NamedTuple):
    """Where the self-test expects a control to be flagged, and for what."""

    scenario: str
    #: Text the scenario's failure must contain (the clause first).
    clause: str
    #: The policies under which the scenario must flag it.
    policies: frozenset[str] = frozenset({"fail", "recompute"})


def flags(record: Mapping[str, Any], flag: Flag) -> bool:
    """Whether one ``report.json`` record is ``flag``: the scenario's verdict of failure,
    for the flag's reason. A harness error (``outcome == "error"``: the installed vLLM
    lacks a feature the tool needs) never is, whatever its message says: the control was
    not judged."""
    return (
        record.get("outcome") == "failed"
        and record.get("scenario") == flag.scenario
        and record.get("policy") in flag.policies
        and flag.clause in str(record.get("reason", ""))
    )


#: What the self-test expects each control to be flagged by.
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
}

#: Further scenarios that must flag a control besides its :data:`EXPECTED_FLAGS` one: the
#: soak sums its oracles over every request, so a control that loses concurrent failures
#: must be caught there too, not only by the scenario built for it.
EXTRA_FLAGS: dict[str, tuple[Flag, ...]] = {
    "ReportsOneFailurePerStep": (Flag("test_soak_random_faults", "C2/C10 liveness"),),
}


# ------------------------------------------------------------------ real connector
#
# Each control is KvfailMooncakeConnector whose built worker gets a subclass of its own
# class with ONE method broken. Why re-class the built worker: the connector builds its
# worker itself, and building a second one would start a second TransferEngine; giving
# the built object a subclass copies nothing and leaves every other method real.


class _SwallowsFailureWorker:
    """Every failure call only logs (pre-#50984 Mooncake): nothing is reported, so the
    request waits; only the tracker's own deadline (30 s by default) could end it."""

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **_: Any) -> bool:
        log.warning("load %s failed (%s): %s", req_id, stage, reason)  # and nothing else
        return True

    def abandon_load(self, req_id: str, stage: Stage | str, reason: str) -> bool:
        log.warning("load %s abandoned (%s): %s", req_id, stage, reason)
        return True


class _ReportsLateWorker:
    """``finished_recving`` on time; the failure (request or blocks) one pass later (C3)."""

    _late_ids: set[str]
    _late_blocks: set[int]

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()  # type: ignore[misc]
        late = getattr(self, "_late_ids", set())
        self._late_ids = set(results.failed_recving)
        results.failed_recving = late
        return results  # type: ignore[no-any-return]

    def get_block_ids_with_load_errors(self) -> set[int]:
        now = super().get_block_ids_with_load_errors()  # type: ignore[misc]
        late = getattr(self, "_late_blocks", set())
        self._late_blocks = set(now)
        return late


class _ReportsUnknownIdWorker:
    """The first time it reports a failure it also reports a made-up id as finished."""

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()  # type: ignore[misc]
        failing = set(results.failed_recving) or (
            set(results.finished_recving) if getattr(self, "_kvfail_invalid", None) else set()
        )
        if failing and not getattr(self, "_made_up_once", False):
            self._made_up_once = True
            results.finished_recving = set(results.finished_recving) | {
                f"{rid}-retry" for rid in failing
            }
        return results  # type: ignore[no-any-return]


class _ReportsSuccessOnFailureWorker:
    """A failed pull is reported as a success (the HF3FS pattern): D's blocks keep
    whatever was there, and the request runs on it."""

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        **_: Any,
    ) -> bool:
        return self.load_succeeded(req_id, peer=peer)  # type: ignore[attr-defined,no-any-return]


try:
    from connectors.mooncake import KvfailMooncakeConnector as _KvfailMooncake
except Exception:  # Mooncake or vLLM's Mooncake module not importable: no real controls
    _KvfailMooncake = None

if _KvfailMooncake is not None:

    class _BrokenMooncake(_KvfailMooncake):  # type: ignore[misc,valid-type]
        """Base of the real controls: the one broken worker method comes from
        ``_broken_worker``, put in front of whatever worker class the connector built."""

        _broken_worker: type

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            worker = getattr(self, "connector_worker", None)
            if worker is not None:
                base = type(worker)
                worker.__class__ = type(
                    f"{self._broken_worker.__name__.strip('_')}({base.__name__})",
                    (self._broken_worker, base),
                    {},
                )

    class SwallowingMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector whose failure calls only log."""

        _broken_worker = _SwallowsFailureWorker

    class LateMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector reporting each failure one pass after finished_recving."""

        _broken_worker = _ReportsLateWorker

    class UnknownIdMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector that once reports an id the scheduler never had."""

        _broken_worker = _ReportsUnknownIdWorker

    class SuccessOnFailureMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector reporting a failed pull as a success."""

        _broken_worker = _ReportsSuccessOnFailureWorker

    __all__ += [
        "LateMooncake",
        "SuccessOnFailureMooncake",
        "SwallowingMooncake",
        "UnknownIdMooncake",
    ]

#: Real-connector controls: class -> (scenario, clause text in the failure reason). The
#: suite's REAL_BUDGET_S is below the connector's default deadline, which is what makes a
#: swallowed failure a liveness violation rather than a late watchdog report.
EXPECTED_FLAGS_REAL: dict[str, Flag] = (
    {
        "SwallowingMooncake": Flag("test_failed_load_one_group", "C2/C10 liveness"),
        "LateMooncake": Flag("test_failed_load_one_group", "C3 late"),
        "UnknownIdMooncake": Flag("test_failed_load_one_group", "C7 crash"),
        "SuccessOnFailureMooncake": Flag("test_failed_load_one_group", "C1 wrong bytes"),
    }
    if _KvfailMooncake is not None
    else {}
)


# ------------------------------------------------------------------ store connector
#
# vLLM's ExampleConnector (files on local disk), driven by ExampleDriver with a P that
# saves real files. Its control breaks the load itself, the way the harness used to make
# it look: the load is skipped with a warning and the step reports nothing, so only the
# integrity oracle (D's positions against P's pattern) can tell.


class SkipsStoreLoad(ExampleConnector):
    """ExampleConnector that matches the stored prefix but never loads it: the scheduler
    counts the tokens as computed and D runs on blocks P's bytes never reached."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        log.warning("SkipsStoreLoad: load skipped (negative control)")


__all__ += ["EXPECTED_FLAGS_STORE", "SkipsStoreLoad"]


class LoadsFromLastChild(MultiConnector):
    """MultiConnector that routes a request's load to the LAST child that matches it,
    not the first: with every child holding P's bytes nothing shows, but a bystander
    child holding other bytes (``store_bystander_damaged``) is what D then runs on."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # vLLM turns the hybrid KV-cache manager off for a MultiConnector by its registry
        # name only (factory.supports_hma_config), so under another name its children's
        # refusal of HMA fails MultiConnector's own assertion. The harness builds one
        # full-attention group, where both managers behave the same: off, as for the
        # reference.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
        super().__init__(vllm_config, role, kv_cache_config)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        chosen: tuple[int | None, bool] = (0, False)
        for i, child in enumerate(self._connectors):
            tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False
            if tokens > 0:
                self._requests_to_connector[request.request_id] = i
                chosen = (tokens, load_async)
        return chosen


class _DropsLoadErrors:
    """Mixed in front of a real connector: every failure its worker found is dropped, so
    a failed load goes out as a finished one (no failed block, no failed request)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()  # type: ignore[misc]
        return set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
        )


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector as _MooncakeStore,
    )
except Exception:  # the store's module is importable wherever vLLM is; be safe anyway
    _MooncakeStore = None

if _MooncakeStore is not None:

    class DropsStoreLoadErrors(_DropsLoadErrors, _MooncakeStore):  # type: ignore[misc,valid-type]
        """MooncakeStoreConnector that drops what its receive threads found: a get that
        failed is reported as a finished load, with no failed block and no failed
        request, so D runs on blocks the store never filled."""

    __all__ += ["DropsStoreLoadErrors"]

try:
    from connectors.example import KvfailExampleConnector as _KvfailExample
except Exception:  # connectors/ is kvfail's own package; be safe anyway
    _KvfailExample = None

if _KvfailExample is not None:

    class SkipsDigestCheck(_KvfailExample):  # type: ignore[misc,valid-type]
        """kvfail's Example connector trusting whatever parses: each layer's file is
        read without checking it against the digest its save path wrote, so a file
        overwritten since (same format, other bytes) loads as a success."""

        def _read_layer(self, path: Any) -> Any:
            from safetensors.torch import load_file

            from connectors.example.connector import TENSOR_KEY

            return load_file(str(path))[TENSOR_KEY]

    class DropsChildErrors(_DropsLoadErrors, MultiConnector):
        """MultiConnector over kvfail's Example children that drops what they report:
        a child's failed load goes out of the parent as a finished one, so D runs on
        blocks no file filled."""

        #: The children the Multi driver builds for it (on P and on D).
        CONFORMANCE_CHILD = (_KvfailExample.__name__, _KvfailExample.__module__)

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            # As LoadsFromLastChild: the hybrid manager is off only under Multi's name.
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
            super().__init__(vllm_config, role, kv_cache_config)

    __all__ += ["DropsChildErrors", "SkipsDigestCheck"]

__all__ += ["STORE_REFERENCES", "STORE_SELECT", "LoadsFromLastChild"]

#: Store-connector controls (``scenarios/test_store_faults.py``): class -> its flag.
EXPECTED_FLAGS_STORE: dict[str, Flag] = {
    "SkipsStoreLoad": Flag("test_store_load_ok", "C1 wrong KV"),
    "LoadsFromLastChild": Flag("test_store_bystander_damaged", "C1 wrong KV"),
    **(
        {"DropsStoreLoadErrors": Flag("test_store_lost_after_lookup", "C1 unreported")}
        if _MooncakeStore is not None
        else {}
    ),
    **(
        {
            "SkipsDigestCheck": Flag("test_store_data_overwritten", "C1 wrong KV"),
            "DropsChildErrors": Flag("test_store_all_children_damaged", "C1 unreported"),
        }
        if _KvfailExample is not None
        else {}
    ),
}
#: Each store control's unbroken reference (a ``--connector`` value): the reference must
#: pass the scenario that flags the control, or the flag is no evidence.
STORE_REFERENCES: dict[str, str] = {
    "SkipsStoreLoad": "vllm:ExampleConnector",
    "LoadsFromLastChild": "vllm:MultiConnector",
    "DropsStoreLoadErrors": "vllm:MooncakeStoreConnector",
    "SkipsDigestCheck": "example",
    "DropsChildErrors": "multi-example",
}
#: A narrower selection (``-k``) than the whole flagging scenario, where one of its
#: parametrizations is evidence enough and each costs a fresh store.
STORE_SELECT: dict[str, str] = {
    "DropsStoreLoadErrors": "(test_store_lost_after_lookup and store_key_removed)",
}


# ------------------------------------------------------------------ NIXL push
#
# Upstream's NixlPushConnector on D, driven by the push driver (P WRITEs into D's blocks).
# Its control drops every failure its worker found, so a push that never came is reported
# as a finished load; flagged where upstream's push D passes
# (``conformance/selftest/test_push_controls.py``).

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPushConnector as _NixlPush,
    )
except Exception:  # NIXL's module imports the nixl package, which may be missing
    _NixlPush = None

if _NixlPush is not None:

    class DropsPushLoadErrors(_DropsLoadErrors, _NixlPush):  # type: ignore[misc,valid-type]
        """NixlPushConnector that reports every load its worker failed as finished: no
        failed block, no failed request."""

    __all__ += ["DropsPushLoadErrors"]

__all__ += ["EXPECTED_FLAGS_PUSH", "PUSH_REFERENCE"]

#: The unbroken reference of the push controls.
PUSH_REFERENCE = "vllm:NixlPushConnector"
#: Push controls: class -> its flag (empty where NIXL cannot be imported).
EXPECTED_FLAGS_PUSH: dict[str, Flag] = (
    {"DropsPushLoadErrors": Flag("test_failed_load_one_group", "C1 unreported")}
    if _NixlPush is not None
    else {}
)
