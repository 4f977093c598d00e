"""``FailureReporterMixin``: the load-error contract, implemented once for every connector.

A worker-role connector mixes this in, calls :meth:`init_failure_reporter` from its
``__init__``, and then needs exactly one call per event:

* a load starts            -> :meth:`track_load`
* a peer task finishes     -> :meth:`load_succeeded`
* anything goes wrong      -> :meth:`load_failed` (or :meth:`abandon_load` before any
                              peer task exists)
* once per engine step     -> return :meth:`transfer_results` from
                              ``get_transfer_results``; ``get_block_ids_with_load_errors``
                              is provided.

Everything the scheduler relies on (pairing failures with completion in one pass, waiting
for every peer, routing by KV-cache group count, never naming ids it no longer tracks,
deadlines) lives in :class:`kvfail.tracker.LoadTracker`; this class is the thin adapter
with names that read well inside a connector.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from typing import Any

from kvfail import compat
from kvfail.compat import UnsupportedLayoutError
from kvfail.load_records import ALL_PEERS, StepReport
from kvfail.quarantine import QuarantineNotice
from kvfail.stages import Stage
from kvfail.stats import FailureStats
from kvfail.tracker import Clock, LoadTracker


class FailureReporterMixin:
    """Mix into a vLLM worker-side KV connector (or its worker object)."""

    _kvfail_tracker: LoadTracker | None = None
    _kvfail_invalid: set[int]
    _kvfail_rank: int = 0

    def init_failure_reporter(
        self,
        *,
        num_kv_cache_groups: int,
        name: str | None = None,
        default_deadline_s: float | None = None,
        request_level_channel: bool | None = None,
        block_level_channel: bool | None = None,
        fence_retry_s: float = 0.0,
        clock: Clock = time.monotonic,
        quarantine: bool = False,
        rank: int = 0,
    ) -> LoadTracker:
        """Set up the tracker. Refuses, here and not at the first failure, a KV layout
        whose failures this vLLM could not be told about.

        ``request_level_channel`` / ``block_level_channel``: None takes them from
        :func:`kvfail.compat.routing`, which detects them on the installed vLLM (block
        level only where it exists and the layout has one group); True or False forces
        that channel (tests, and a connector that knows better).
        ``quarantine``: the connector's scheduler half holds failed loads' blocks
        (:class:`kvfail.vllm_quarantine.QuarantineConnector`), so a load whose transfer
        may still write fails at once (see :meth:`load_failed`'s ``fenced``); ``rank``
        names this worker's TP rank in the quarantine notices.
        """
        route = compat.routing(num_kv_cache_groups)
        if request_level_channel is None:
            request_level_channel = route.request_level
        if block_level_channel is None:
            block_level_channel = route.block_level
        elif num_kv_cache_groups > 1:
            block_level_channel = False  # never, whatever was asked (see routing)
        if not (request_level_channel or block_level_channel):
            raise UnsupportedLayoutError(
                f"{num_kv_cache_groups} KV-cache group(s) need the request-level failure "
                "channel (get_transfer_results().failed_recving, vLLM >= 0.30), which the "
                f"installed vLLM lacks; block level is no way out here: "
                f"{route.why_not_blocks or 'it was switched off'}. Use one KV-cache group "
                "or upgrade vLLM."
            )
        override = type(self).kvfail_fence is not FailureReporterMixin.kvfail_fence
        self._kvfail_tracker = LoadTracker(
            num_kv_cache_groups=num_kv_cache_groups,
            name=name or type(self).__name__,
            default_deadline_s=default_deadline_s,
            request_level_available=request_level_channel,
            block_level_available=block_level_channel,
            fence=self.kvfail_fence if override else None,
            fence_retry_s=fence_retry_s,
            clock=clock,
            quarantine=quarantine,
        )
        self._kvfail_invalid = set()
        self._kvfail_rank = rank
        return self._kvfail_tracker

    @property
    def failure_reporter(self) -> LoadTracker:
        tracker = self._kvfail_tracker
        if tracker is None:
            raise RuntimeError(
                f"{type(self).__name__} uses FailureReporterMixin but never called "
                "init_failure_reporter() in its __init__"
            )
        return tracker

    # ---------------------------------------------------------------- events

    def track_load(
        self,
        req_id: str,
        block_ids: object,
        *,
        peers: int | Iterable[Hashable] = 1,
        deadline_s: float | None = None,
    ) -> bool:
        """Register a load into ``block_ids`` (flat, or one list per KV-cache group).

        ``peers`` is a count or the names of the peer tasks (P workers, TP ranks) that
        must all settle before the load is delivered. No peers (``0``, ``[]``) means
        nobody will write the blocks: the load fails at once, every block. An empty
        ``block_ids`` marks a notify-only pull: it is settled but never reported.
        """
        return self.failure_reporter.track(req_id, block_ids, peers=peers, deadline_s=deadline_s)

    def expect_peers(self, req_id: str, peers: int | Iterable[Hashable]) -> bool:
        """Name the peer tasks once known (after a bootstrap); same meaning as in
        :meth:`track_load`, so no peers fails a load with blocks, never succeeds it."""
        return self.failure_reporter.expect_peers(req_id, peers)

    def load_succeeded(self, req_id: str, *, peer: Hashable | None = None) -> bool:
        return self.failure_reporter.succeeded(req_id, peer=peer)

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
        fenced: bool = True,
    ) -> bool:
        """The one failure call. Safe from any thread or event loop; idempotent; sticky.

        ``fenced=False`` when the transfer may still write into the blocks (quarantine
        only): reported now, its blocks held until :meth:`load_fenced`."""
        return self.failure_reporter.failed(
            req_id, stage, reason, peer=peer, settle=settle, block_ids=block_ids, fenced=fenced
        )

    def load_fenced(self, req_id: str) -> bool:
        """The transfer of ``req_id`` can no longer write: a quarantined load's blocks go
        back to the scheduler with this step's output."""
        return self.failure_reporter.fenced(req_id)

    def take_quarantine_notice(self) -> QuarantineNotice:
        """This step's holds and releases, for ``build_connector_worker_meta`` (see
        :mod:`kvfail.vllm_quarantine`); called after the step's drain."""
        held, released = self.failure_reporter.take_quarantine_notice()
        rank = self._kvfail_rank
        return QuarantineNotice({(r, rank) for r in held}, {(r, rank) for r in released})

    def abandon_load(self, req_id: str, stage: Stage | str, reason: str) -> bool:
        """Fail a load and settle all its peer tasks: nothing was started, or all stopped."""
        return self.failure_reporter.failed(req_id, stage, reason, peer=ALL_PEERS)

    def fail_loads(
        self,
        req_ids: Iterable[str],
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
    ) -> int:
        """Fail several loads for one cause (a batch, a peer); returns how many were known."""
        failed = self.failure_reporter.failed
        return sum(failed(r, stage, reason, peer=peer) for r in req_ids)

    def kvfail_fence(self, req_id: str) -> bool:
        """Called when a load's deadline passes with peer tasks outstanding.

        Override to cancel the transfer (release its handle, drop the peer). Return True
        only when nothing can still write into the load's blocks; returning False keeps
        the request (and its blocks) held and the fence is retried at later drains.
        """
        return True

    # ---------------------------------------------------------------- per step

    def drain_step(self) -> StepReport:
        """Drain once per step; invalid blocks wait for get_block_ids_with_load_errors().

        Raises :class:`kvfail.compat.NoFailureChannelError` for a failed load that this
        vLLM offers no channel for (see :class:`~kvfail.load_records.StepReport`). Why
        raise: such a load could only be delivered as finished (the request would run
        on KV that never arrived) or kept back for ever (its request would hang in
        WAITING_FOR_REMOTE_KVS holding its blocks, in silence). An error from the
        worker's completion poll stops the engine instead: vLLM's engine core fails
        every request in flight with an error naming the cause, so no request is served
        from missing KV and the operator learns which vLLM feature the deployment lacks
        (docs/contract.md, "No failure channel").
        """
        report = self.failure_reporter.drain()
        if report.invalid_block_ids:
            self._kvfail_invalid.update(report.invalid_block_ids)
        if report.unreportable:
            raise compat.NoFailureChannelError(report.unreportable, self.failure_reporter.name)
        return report

    def transfer_results(
        self,
        finished_sending: Iterable[str] = (),
        *,
        finished_recving: Iterable[str] = (),
    ) -> Any:
        """Build this step's ``KVConnectorTransferResults`` (call from get_transfer_results).

        ``finished_recving`` is for loads the connector completes outside the tracker;
        tracked loads are added here, failed ones included.
        """
        report = self.drain_step()
        recving = set(report.finished_recving)
        recving.update(finished_recving)
        # On a vLLM without the request-level channel the tracker routed every failure
        # to blocks (several groups were refused at construction), so failed_recving is
        # empty there and the class is kvfail's stand-in.
        return compat.make_transfer_results(finished_sending, recving, report.failed_recving)

    def get_transfer_results(self, *args: Any) -> Any:
        """The next class's results (a connector's ``super().get_transfer_results()``
        reaches upstream through here), in the results shape on every vLLM: where upstream
        has only the older ``get_finished``, its ``(sending, recving)`` tuple is wrapped.

        A connector overrides this and returns :meth:`transfer_results`; this default only
        adapts what upstream hands over.
        """
        upstream = super()
        method = getattr(upstream, "get_transfer_results", None)
        if method is not None:
            return method(*args)
        return compat.results_from_finished(upstream.get_finished(*args))  # type: ignore[misc]

    def get_finished(self, *args: Any) -> tuple[set[str] | None, set[str] | None]:
        """The completion poll of vLLM releases without ``get_transfer_results``: the
        connector's own ``get_transfer_results`` (same arguments), in the older
        ``(sending, recving)`` shape. Failed loads are in ``recving`` (they finished);
        their blocks reach the scheduler through ``get_block_ids_with_load_errors``.

        A connector on this mixin writes ``get_transfer_results`` once and runs on both
        kinds of vLLM. Re-entered through vLLM's default ``get_transfer_results`` (which
        calls ``get_finished``: a connector that did not override it), it answers with
        the tracker's own results instead of recursing; never a raise in a load hook.
        """
        if getattr(self, "_kvfail_in_get_finished", False):
            return compat.finished_pair(self.transfer_results())
        self._kvfail_in_get_finished = True
        try:
            results = self.get_transfer_results(*args)
        finally:
            self._kvfail_in_get_finished = False
        return compat.finished_pair(results)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM's block-level channel: blocks from this step's drain, then cleared."""
        invalid = self._kvfail_invalid
        if not invalid:
            return set()
        self._kvfail_invalid = set()
        return invalid

    def failure_stats(self) -> FailureStats:
        return self.failure_reporter.stats()

    def take_failure_stats(self) -> FailureStats:
        """Counters since the last call, for vLLM's per-interval connector stats."""
        return self.failure_reporter.take_interval_stats()
