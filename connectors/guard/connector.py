"""``KvfailGuardConnector``: kvfail's load-error contract around any KV connector.

Configured with vLLM's usual options, no code change in the guarded connector::

    --kv-transfer-config '{"kv_connector":"KvfailGuardConnector",
      "kv_connector_module_path":"connectors.guard","kv_role":"kv_both",
      "kv_connector_extra_config":{"inner":"MooncakeConnector",
                                   "inner_extra_config":{...},"deadline_s":30}}'

Everything goes to the inner connector, built with a copy of the vLLM config whose
``kv_transfer_config`` carries the inner's own extra config (as vLLM's MultiConnector
builds its children). What the guard adds is on the load path only:

* the scheduler half records every load it promised (the async loads the inner
  advertised, with their blocks and P's advertised address) and sends them to the
  workers in its own metadata, next to the inner's: the guard knows a load even when
  the inner drops it (upstream Mooncake drops unusable params without a word);
* the worker tracks each load from its ``start_load_kv`` (the deadline counts from
  there, not from admission) in :class:`kvfail.FailureReporterMixin`'s tracker, and
  turns whatever the inner reports into tracker events: exactly-once delivery, unknown
  and late ids dropped, request-level failures with several KV-cache groups, no report
  for a load of no blocks;
* a load failed at its deadline keeps its blocks in quarantine
  (:class:`kvfail.vllm_quarantine.QuarantineConnector`) until the inner reports it, or
  its P is proven gone (:mod:`connectors.guard.peer`); past the cap, new remote loads
  are computed locally;
* the inner's lookups are bounded (:mod:`connectors.guard.lookup`): past the lookup
  deadline, or while an earlier lookup is stuck, the answer is "nothing to load";
* a request whose load failed is not offered a load again: its recompute is computed
  locally, never matched anew by the inner to the source that just failed for it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)

from connectors.guard.config import GuardConfig, lookup_deadline_s, parse_guard_config
from connectors.guard.lookup import BoundedCalls
from connectors.guard.passthrough import PassThroughConnector
from connectors.guard.peer import peer_address, peer_refuses
from connectors.guard.stats import GuardPromMetrics, GuardStats
from kvfail import compat
from kvfail.reporter import FailureReporterMixin
from kvfail.stages import Stage
from kvfail.vllm_quarantine import KvfailWorkerMeta, QuarantineConnector, _cap_from
from kvfail.vllm_stats import PREFIX, KvfailPromMetrics, KVFailStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "GUARD_EVENTS",
    "GuardLoad",
    "GuardMetadata",
    "KvfailGuardConnector",
    "inner_class_and_config",
]

logger = logging.getLogger("kvfail.guard")

#: The scheduler half's own counters (stats ``kvfail.<name>``, and
#: ``vllm:kvfail_events_total{event=<name>}``): lookups past the lookup deadline, lookups
#: answered at once while one is stuck, and lookups of a request whose load failed.
GUARD_EVENTS = ("lookups_timed_out", "lookups_refused_stuck", "loads_refused_failed_before")


@dataclass(frozen=True)
class GuardLoad:
    """One async load the scheduler promised: its blocks per KV-cache group, and the
    address P advertised (None: the params name none; see :mod:`connectors.guard.peer`)."""

    groups: tuple[tuple[int, ...], ...]
    address: tuple[str, int] | None = None


@dataclass
class GuardMetadata(KVConnectorMetadata):
    """The inner's metadata, plus this step's new async loads and sync-load blocks."""

    inner: KVConnectorMetadata | None
    loads: dict[str, GuardLoad] = field(default_factory=dict)
    #: Blocks this step's synchronous loads write: the inner's failures on these go to
    #: the scheduler as they are (a sync load is not tracked, it ends in this step).
    sync_blocks: frozenset[int] = frozenset()


def inner_class_and_config(vllm_config: VllmConfig) -> tuple[type, VllmConfig, GuardConfig]:
    """The inner connector's class, the vLLM config it is built with, and the guard's."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    config = parse_guard_config(transfer.kv_connector_extra_config)
    module, sep, name = config.inner.rpartition(":")
    inner_transfer = KVTransferConfig(
        **{
            **{f.name: getattr(transfer, f.name) for f in dataclasses.fields(transfer)},
            "kv_connector": name,
            "kv_connector_module_path": module if sep else None,
            "kv_connector_extra_config": dict(config.inner_extra_config),
        }
    )
    inner_config = copy.copy(vllm_config)
    inner_config.kv_transfer_config = inner_transfer
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and not KVConnectorFactory.supports_hma_config(inner_transfer):
        # vLLM keeps the hybrid KV-cache manager on for the guard (it supports HMA); an
        # inner without HMA support sees the setting it would have had alone. Several
        # groups with such an inner are refused in the guard's __init__.
        inner_config.scheduler_config = copy.copy(scheduler)
        inner_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return KVConnectorFactory.get_connector_class(inner_transfer), inner_config, config


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no TP group (a world of one): rank 0
        return 0


class KvfailGuardConnector(
    FailureReporterMixin, QuarantineConnector, PassThroughConnector, SupportsHMA
):
    """See the module docstring. Both roles in one class, as vLLM builds any connector."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        inner_cls, inner_config, config = inner_class_and_config(vllm_config)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        inner_hma = not inner_config.scheduler_config.disable_hybrid_kv_cache_manager
        if groups > 1 and not (supports_hma(inner_cls) and inner_hma):
            raise ValueError(
                f"KvfailGuardConnector: {groups} KV-cache groups, but the inner connector "
                f"{inner_cls.__name__} does not support HMA"
            )
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.guard_config = config
        #: The load deadline the worker enforces, declared for the conformance suite.
        self.kv_load_deadline_s = config.deadline_s
        self._guard_inner_cls = inner_cls
        # Scheduler half: what get_num_new_matched_tokens promised, and this step's loads.
        self._matched: dict[str, tuple[bool, int]] = {}
        self._new_loads: dict[str, GuardLoad] = {}
        self._sync_blocks: set[int] = set()
        #: The blocks of each request's load since its allocation (async or sync), to
        #: name the request a failed block belongs to; and the requests whose load failed.
        self._load_blocks: dict[str, frozenset[int]] = {}
        self._failed_before: set[str] = set()
        #: When the inner first answered "not yet" (None) for a request still asking.
        self._lookup_pending: dict[str, float] = {}
        self._guard_events: Counter[str] = Counter()
        self._lookups = BoundedCalls(inner_cls.__name__, lookup_deadline_s(config))
        # Worker half: loads bound but not started, and what each tracked load holds.
        self._starting: dict[str, GuardLoad] = {}
        self._loads: dict[str, GuardLoad] = {}
        self._step_sync_blocks: frozenset[int] = frozenset()
        self._delivered_failed: set[str] = set()
        if role == KVConnectorRole.WORKER:
            self.init_failure_reporter(
                num_kv_cache_groups=groups,
                name=f"KvfailGuardConnector[{inner_cls.__name__}]",
                default_deadline_s=config.deadline_s,
                fence_retry_s=config.fence_retry_s,
                quarantine=compat.block_pool_binding_available(),
                rank=_tp_rank(),
            )
        self._guard_inner = inner_cls(inner_config, role, kv_cache_config)

    # ------------------------------------------------------------ configuration hooks

    def kvfail_quarantine_cap(self, num_blocks: int) -> int:
        cap = self.guard_config.quarantine_max_blocks
        return _cap_from(self, num_blocks) if cap is None else cap

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GuardStats:
        return GuardStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> GuardPromMetrics:
        ours = KvfailPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, GUARD_EVENTS
        )
        inner = None
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            inner_cls, inner_config, _ = inner_class_and_config(vllm_config)
            inner = inner_cls.build_prom_metrics(
                inner_config, metric_types, labelnames, per_engine_labelvalues
            )
        return GuardPromMetrics(ours, inner)

    # ------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        if req_id in self._failed_before:
            # Its load failed: the recompute is computed here. Asking the inner again would
            # match the same source (a store whose master still lists lost keys), and load
            # from it again and again (vLLM #55297, C12).
            self._matched.pop(req_id, None)
            self._guard_events["loads_refused_failed_before"] += 1
            return 0, False
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens is None:
            tokens, load_async = self._bounded_not_yet(req_id)
        else:
            self._lookup_pending.pop(req_id, None)
        if tokens:
            self._matched[request.request_id] = (load_async, num_computed_tokens)
        else:
            self._matched.pop(request.request_id, None)
        return tokens, load_async

    def _guard_scheduler_call(self, what: str, call: Any, fallback: Any) -> Any:
        """The inner's call, bounded by the lookup deadline (:mod:`connectors.guard.lookup`);
        ``fallback`` when it is past the deadline or an earlier call is stuck."""
        outcome = self._lookups.call(what, call)
        if outcome.done:
            return outcome.value
        event = "lookups_timed_out" if outcome.timed_out else "lookups_refused_stuck"
        self._guard_events[event] += 1
        return fallback

    def _bounded_not_yet(self, req_id: str) -> tuple[int | None, bool]:
        """The inner answered "not yet" (its lookup runs on its own): the request waits
        for it at most the lookup deadline, then is computed locally."""
        now = time.monotonic()
        since = self._lookup_pending.setdefault(req_id, now)
        if now - since < self._lookups.deadline_s:
            return None, False
        del self._lookup_pending[req_id]
        self._guard_events["lookups_timed_out"] += 1
        logger.warning(
            "kvfail guard: %s's lookup of %s not ready within %.3g s: computed locally",
            self._guard_inner_cls.__name__,
            req_id,
            self._lookups.deadline_s,
        )
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        address = peer_address(params)  # read first: the inner may rewrite the params
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens <= 0:
            return
        load_async, num_local = matched
        groups = self._external_blocks(blocks, num_local, num_external_tokens)
        self._load_blocks[request.request_id] = frozenset(b for g in groups for b in g)
        if load_async:
            self._new_loads[request.request_id] = GuardLoad(groups, address)
        else:
            self._sync_blocks.update(b for g in groups for b in g)

    def _external_blocks(
        self, blocks: KVCacheBlocks, num_local: int, num_external: int
    ) -> tuple[tuple[int, ...], ...]:
        """The blocks the external tokens go into, per KV-cache group: from the first
        block past the local hit to the one holding the last external token (a failure
        names at least every block that may be missing, and no locally computed one)."""
        specs = self._kv_cache_config.kv_cache_groups if self._kv_cache_config else ()
        out = []
        for index, group in enumerate(blocks.blocks):
            size = specs[index].kv_cache_spec.block_size if index < len(specs) else 1
            first, end = num_local // size, -(-(num_local + num_external) // size)
            out.append(tuple(b.block_id for b in group[first:end] if not b.is_null))
        return tuple(out)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Notes each request whose load failed (by id, or by a failed block of its load),
        before the scheduler reschedules it; a load that finished well is forgotten."""
        failed = set(connector_output.failed_recving or ())
        invalid = connector_output.invalid_block_ids or set()
        if invalid:
            failed.update(r for r, blocks in self._load_blocks.items() if blocks & invalid)
        for req_id in failed:
            self._load_blocks.pop(req_id, None)
        self._failed_before.update(failed)
        for req_id in connector_output.finished_recving or ():
            if req_id not in failed:
                self._load_blocks.pop(req_id, None)
        super().update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GuardMetadata:
        for req_id in scheduler_output.preempted_req_ids or ():
            # Its blocks go back to the pool: a failure named in them is another's.
            self._load_blocks.pop(req_id, None)
        meta = GuardMetadata(
            inner=self._guard_inner.build_connector_meta(scheduler_output),
            loads=self._new_loads,
            sync_blocks=frozenset(self._sync_blocks),
        )
        self._new_loads = {}
        self._sync_blocks = set()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _forget(self, req_id: str) -> None:
        self._matched.pop(req_id, None)
        self._load_blocks.pop(req_id, None)
        self._failed_before.discard(req_id)
        self._lookup_pending.pop(req_id, None)

    def shutdown(self) -> None:
        self._lookups.close()
        super().shutdown()

    # ------------------------------------------------------------ worker role

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(connector_metadata, GuardMetadata):
            self._starting.update(connector_metadata.loads)
            self._step_sync_blocks = connector_metadata.sync_blocks
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Tracked before the inner starts them: the deadline counts from this call.
        starting, self._starting = self._starting, {}
        for req_id, load in starting.items():
            if self.track_load(req_id, load.groups, peers=1):
                self._loads[req_id] = load
        self._inner_load_step(
            "start_load_kv", starting, self._guard_inner.start_load_kv, forward_context, **kwargs
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner_load_step(
            "wait_for_layer_load", {}, self._guard_inner.wait_for_layer_load, layer_name
        )

    def _inner_load_step(
        self, what: str, started: Mapping[str, GuardLoad], call: Any, *args: Any, **kwargs: Any
    ) -> None:
        """One call into the inner's load path. A raise there would end the engine, and
        a synchronous load it cut short would run on whatever its blocks hold: the loads
        started in this call, and every block of this step's synchronous loads, are
        reported failed instead."""
        try:
            call(*args, **kwargs)
        except Exception as exc:
            logger.exception("kvfail guard: the inner connector's %s raised", what)
            self.fail_loads(started, Stage.INTERNAL, f"inner {what} raised: {exc!r}")
            self._kvfail_invalid.update(self._step_sync_blocks)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """The inner's results and failed blocks, read together, turned into tracker
        events; then this step's drain (the guard's own results)."""
        inner = self._guard_inner
        if hasattr(inner, "get_transfer_results"):
            results = inner.get_transfer_results(finished_req_ids)
        else:  # a vLLM without it: the older (sending, recving) poll
            results = compat.results_from_finished(inner.get_finished(finished_req_ids))
        self._absorb_invalid(inner.get_block_ids_with_load_errors())
        failed = set(getattr(results, "failed_recving", ()) or ())
        for req_id in {*results.finished_recving, *failed}:
            self._absorb_finished(req_id, req_id in failed)
        out = self.transfer_results(results.finished_sending)
        self._delivered_failed.update(out.failed_recving)
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return compat.finished_pair(self.get_transfer_results(finished_req_ids))

    def _absorb_invalid(self, invalid: Iterable[int]) -> None:
        blocks = set(invalid)
        if not blocks:
            return
        passed = blocks & self._step_sync_blocks
        if passed:
            self._kvfail_invalid.update(passed)
        rest = blocks - passed
        for req_id, load in self._loads.items():
            mine = rest.intersection(b for g in load.groups for b in g)
            if mine and self.failure_reporter.is_tracked(req_id):
                self.load_failed(
                    req_id,
                    Stage.TRANSFER,
                    f"the inner connector reported {len(mine)} blocks failed",
                    settle=False,
                    block_ids=sorted(mine),
                )
            rest -= mine
        if rest:
            logger.warning(
                "kvfail guard: dropped %d failed block ids the inner named outside any "
                "load in flight: %s",
                len(rest),
                sorted(rest)[:8],
            )

    def _absorb_finished(self, req_id: str, failed: bool) -> None:
        tracker = self.failure_reporter
        if tracker.is_tracked(req_id):
            if failed:
                self.load_failed(req_id, Stage.TRANSFER, "the inner connector reported it failed")
            else:
                self.load_succeeded(req_id)
            self._loads.pop(req_id, None)
        elif req_id in self._loads:
            # Delivered already (its deadline): the inner is done with it, so nothing can
            # write into its blocks any more, and a held quarantine can end.
            self._loads.pop(req_id, None)
            if not self.load_fenced(req_id):
                logger.info("kvfail guard: late report for %s dropped", req_id)
        else:
            self.load_succeeded(req_id)  # refused and counted: unknown or late

    def kvfail_fence(self, req_id: str) -> bool:
        """At the deadline, and at each retry for a held load: True only when P is
        proven gone (its advertised address refuses connections)."""
        load = self._loads.get(req_id)
        if load is None or load.address is None:
            return False
        gone = peer_refuses(load.address, self.guard_config.probe_timeout_s)
        if gone:
            logger.warning(
                "kvfail guard: P of %s at %s:%d refuses connections: its load is fenced",
                req_id,
                *load.address,
            )
        return gone

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self._guard_inner.build_connector_worker_meta()
        if self._kvfail_tracker is None:
            return inner
        notice = self.take_quarantine_notice()
        held = {req_id for req_id, _ in notice.held}
        # Loads delivered failed and not held: nothing is left to wait for.
        for req_id in self._delivered_failed - held:
            self._loads.pop(req_id, None)
        for req_id, _ in notice.released:
            self._loads.pop(req_id, None)
        self._delivered_failed = set()
        if not notice:
            return inner
        return KvfailWorkerMeta(notice=notice, inner=inner)

    def _guard_own_stats(self) -> KVFailStats | None:
        """The worker's counters for this interval; the scheduler's :data:`GUARD_EVENTS`
        (the scheduler half also adds the quarantine's gauges:
        :class:`kvfail.vllm_quarantine.QuarantineConnector`)."""
        if self._kvfail_tracker is None:
            events, self._guard_events = self._guard_events, Counter()
            data = {PREFIX + name: count for name, count in events.items() if count}
            return KVFailStats(data=data) if data else None
        return KVFailStats.from_failure_stats(self.take_failure_stats())
