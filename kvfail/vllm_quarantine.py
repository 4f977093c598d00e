"""The quarantine wired into a vLLM connector (see :mod:`kvfail.quarantine` for the why).

This module imports vLLM; ``import kvfail`` does not. A connector puts
:class:`QuarantineConnector` in front of its upstream class (as it does
:class:`kvfail.vllm_stats.KvfailMetricsConnector`) and its worker half, a
:class:`kvfail.FailureReporterMixin`, provides ``take_quarantine_notice()``. Then:

* worker role: ``build_connector_worker_meta`` carries this step's holds and releases
  next to whatever upstream's worker metadata is (vLLM aggregates TP ranks with
  ``aggregate``);
* scheduler role: ``bind_kv_cache_manager`` gives the block pool (on a vLLM that binds
  the pool alone, ``bind_gpu_block_pool``; see :class:`_RecordedLoads`),
  ``update_connector_output`` applies the notices before vLLM frees the request's blocks,
  ``get_num_new_matched_tokens`` takes no remote load once the cap is reached,
  ``has_pending_push_work`` keeps the engine stepping while blocks are held (the release
  notices come with steps), and ``get_kv_connector_stats`` reports them as a gauge.

Configuration (``kv_connector_extra_config``): ``kvfail_quarantine_max_blocks``, the cap
on held blocks; default a quarter of the KV cache (:data:`DEFAULT_CAP_FRACTION`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvfail import compat
from kvfail.quarantine import BlockQuarantine, QuarantineNotice, hold_rank

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "CAP_KEY",
    "DEFAULT_CAP_FRACTION",
    "KvfailWorkerMeta",
    "QuarantineConnector",
    "worker_hold_rank",
]

log = logging.getLogger("kvfail.quarantine")

#: ``kv_connector_extra_config`` key: the most blocks the quarantine may hold.
CAP_KEY = "kvfail_quarantine_max_blocks"
#: Default cap, as a fraction of the KV cache's blocks: enough for a burst of slow Ps,
#: while three quarters of the cache keep serving (beyond it, requests compute locally).
DEFAULT_CAP_FRACTION = 0.25
#: A hold lasting this many load deadlines is named in one WARNING with its P.
WARN_AFTER_DEADLINES = 4
#: ... and this long where the connector declares no deadline.
WARN_AFTER_S = 120.0
#: While only holds keep the engine stepping, at most one step per this many seconds:
#: a release notice comes with a step, and nothing else needs one.
HOLD_STEP_S = 0.05


@dataclass
class KvfailWorkerMeta(KVConnectorWorkerMetadata):
    """kvfail's notices, wrapped around upstream's own worker metadata (if any)."""

    notice: QuarantineNotice = field(default_factory=QuarantineNotice)
    inner: KVConnectorWorkerMetadata | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvfailWorkerMeta:
        if not isinstance(other, KvfailWorkerMeta):
            other = KvfailWorkerMeta(inner=other)
        self.notice.merge(other.notice)
        if self.inner is None:
            self.inner = other.inner
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        return self


def worker_hold_rank(vllm_config: Any, tp_rank: int) -> int:
    """This worker's rank in quarantine notices (:func:`kvfail.quarantine.hold_rank`):
    its TP rank within its pipeline stage, made unique across stages. Where vLLM's
    parallel groups are not set up (one process plays a rank), the stage is 0."""
    from vllm.distributed import parallel_state

    pp_rank = 0
    if parallel_state.model_parallel_is_initialized():
        pp_rank = parallel_state.get_pp_group().rank_in_group
    return hold_rank(tp_rank, vllm_config.parallel_config.tensor_parallel_size, pp_rank)


def _cap_from(connector: Any, num_blocks: int) -> int:
    transfer = connector._vllm_config.kv_transfer_config
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    value = extra.get(CAP_KEY)
    if value is None:
        return max(1, int(num_blocks * DEFAULT_CAP_FRACTION))
    try:
        cap = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{CAP_KEY} must be a whole number of blocks, not {value!r}") from None
    if cap < 0:
        raise ValueError(f"{CAP_KEY} must be >= 0, not {cap}")
    return cap


class _RecordedLoads:
    """A request's blocks for a vLLM that binds the block pool but not the cache manager
    (no ``bind_kv_cache_manager``), which cannot be asked for a request's blocks.

    An async load's blocks are recorded at allocation (``update_state_after_alloc``): they
    are all the request holds while it waits, and vLLM keeps them until the load's
    ``finished_recving`` (even for a request finished meanwhile), so the record is
    dropped with that report, after the step's holds were taken.

    Such a vLLM also lacks the request-level channel, so a held load reaches it as
    invalid blocks (every block of the load, see :class:`kvfail.tracker.LoadTracker`).
    Under ``recompute`` vLLM would then keep the request's blocks past its valid prefix
    and recompute into them, the very blocks P may still write: :meth:`drop_computed`
    sets the request back to no computed token, as a request-level failure does, so
    vLLM frees every block (the held ones stay out of the pool) and the request
    recomputes into fresh ones.
    """

    def __init__(self) -> None:
        #: Requests whose last ``get_num_new_matched_tokens`` promised an async load.
        self.async_pending: set[str] = set()
        self.loads: dict[str, tuple[Request, list[Any]]] = {}

    def matched(self, req_id: str, num_tokens: int | None, load_async: bool) -> None:
        if load_async and num_tokens:
            self.async_pending.add(req_id)
        else:
            self.async_pending.discard(req_id)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        req_id = request.request_id
        if req_id in self.async_pending and num_external > 0:
            self.loads[req_id] = (request, [b for group in blocks.blocks for b in group])
        self.async_pending.discard(req_id)

    def blocks_of(self, req_id: str) -> list[Any] | None:
        entry = self.loads.get(req_id)
        if entry is None or not entry[1]:
            return None
        return entry[1]

    def drop_computed(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            entry = self.loads.get(req_id)
            if entry is not None and not entry[0].is_finished():
                entry[0].num_computed_tokens = 0

    def reported(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.loads.pop(req_id, None)


class QuarantineConnector:
    """Mix in front of an upstream connector class (see the module docstring)."""

    _kvfail_quarantine: BlockQuarantine | None = None
    #: Set where vLLM binds the block pool alone (see :class:`_RecordedLoads`).
    _kvfail_recorded: _RecordedLoads | None = None
    #: Remote loads turned away since the last stats interval.
    _kvfail_refused_loads: int = 0
    #: The levels last put in the stats: a level is sent only when it changes.
    _kvfail_levels_sent: tuple[int, int] = (0, 0)
    #: Ps with held loads in the last stats sent (a P that left gets one 0).
    _kvfail_peers_sent: frozenset[str] = frozenset()
    #: Scheduler steps seen (``build_connector_meta``), and the step of the last pause.
    _kvfail_steps: int = 0
    _kvfail_paused_at: int = -1

    # ---------------------------------------------------------------- worker role

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = super().build_connector_worker_meta()  # type: ignore[misc]
        # Upstream's split connectors keep the worker half apart; a one-class connector
        # (both roles in one class) is its own worker.
        worker = getattr(self, "connector_worker", self)
        take = getattr(worker, "take_quarantine_notice", None)
        notice = take() if take is not None else QuarantineNotice()
        if not notice:
            return inner  # type: ignore[no-any-return]
        return KvfailWorkerMeta(notice=notice, inner=inner)

    # ---------------------------------------------------------------- scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)  # type: ignore[misc]
        pool = kv_cache_manager.block_pool

        def blocks_of(req_id: str) -> list[Any] | None:
            # Every group's blocks; none at all once the scheduler let the request go.
            blocks = [b for group in kv_cache_manager.get_blocks(req_id).blocks for b in group]
            return blocks or None

        self._kvfail_quarantine = BlockQuarantine(
            pool, blocks_of, max_blocks=self.kvfail_quarantine_cap(pool.num_gpu_blocks)
        )

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)  # type: ignore[misc]
        if compat.kv_cache_manager_binding_available():
            return  # bind_kv_cache_manager (which calls this one) builds the quarantine
        recorded = _RecordedLoads()
        self._kvfail_recorded = recorded
        self._kvfail_quarantine = BlockQuarantine(
            gpu_block_pool,
            recorded.blocks_of,
            max_blocks=self.kvfail_quarantine_cap(gpu_block_pool.num_gpu_blocks),
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]
        if self._kvfail_recorded is not None:
            self._kvfail_recorded.allocated(request, blocks, num_external_tokens)

    def kvfail_quarantine_cap(self, num_blocks: int) -> int:
        """The most blocks held at once, for a pool of ``num_blocks``: read from
        :data:`CAP_KEY`; a connector with its own configuration overrides this."""
        return _cap_from(self, num_blocks)

    @property
    def quarantine(self) -> BlockQuarantine | None:
        """The scheduler side's quarantine (None in a worker, or before vLLM binds it)."""
        return self._kvfail_quarantine

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        recorded = self._kvfail_recorded
        if isinstance(meta, KvfailWorkerMeta):
            if self._kvfail_quarantine is not None:
                self._kvfail_quarantine.apply(meta.notice)
                if self._kvfail_quarantine:
                    self._kvfail_quarantine.say_overdue(self._kvfail_warn_after_s())
                if recorded is not None:
                    recorded.drop_computed(req_id for req_id, _ in meta.notice.held)
            elif meta.notice.held:
                log.error(
                    "kvfail: %d loads to quarantine, but vLLM never bound the block pool",
                    len(meta.notice.held),
                )
            connector_output = dataclasses.replace(
                connector_output, kv_connector_worker_meta=meta.inner
            )
        if recorded is not None:
            recorded.reported(connector_output.finished_recving or ())
        super().update_connector_output(connector_output)  # type: ignore[misc]

    def _kvfail_warn_after_s(self) -> float:
        deadline = getattr(self, "kv_load_deadline_s", None)
        if isinstance(deadline, int | float) and deadline > 0:
            return WARN_AFTER_DEADLINES * float(deadline)
        return WARN_AFTER_S

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._kvfail_steps += 1
        return super().build_connector_meta(scheduler_output)  # type: ignore[misc]

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks are held: only a step brings the
        workers' release notices, and an engine with no requests does not step.

        vLLM asks only when the scheduler has no request of its own, and then steps as
        fast as it can (a 1 ms pause). With only holds left, that is a core spent on
        steps that release nothing, so the first ask after each step pauses
        :data:`HOLD_STEP_S` (a new request waits at most that long) and the others in
        the same loop pass through."""
        if super().has_pending_push_work():  # type: ignore[misc]
            return True
        if not self._kvfail_quarantine:
            return False
        if self._kvfail_paused_at != self._kvfail_steps:
            self._kvfail_paused_at = self._kvfail_steps
            time.sleep(HOLD_STEP_S)
        return True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        quarantine = self._kvfail_quarantine
        if quarantine is not None and quarantine.full():
            params = request.kv_transfer_params
            if isinstance(params, dict) and params.get("do_remote_prefill"):
                # No external tokens: D computes the prompt itself, and the connector
                # still sees the params at allocation (a pull of no blocks tells P to
                # free its copy, as for a full local prefix hit).
                self._kvfail_refused_loads += 1
                log.warning(
                    "kvfail: %d blocks quarantined (cap %s): %s computes locally",
                    quarantine.blocks_held,
                    quarantine.max_blocks,
                    request.request_id,
                )
                return 0, False
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens
        )
        if self._kvfail_recorded is not None:
            self._kvfail_recorded.matched(request.request_id, *result)
        return result

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = super().get_kv_connector_stats()  # type: ignore[misc]
        quarantine = self._kvfail_quarantine
        if quarantine is None or getattr(self, "role", None) != KVConnectorRole.SCHEDULER:
            return stats  # type: ignore[no-any-return]
        levels = (quarantine.blocks_held, len(quarantine))
        # While anything is held the oldest hold's age moves, so it is sent every time.
        if not quarantine and levels == self._kvfail_levels_sent and not self._kvfail_refused_loads:
            return stats  # type: ignore[no-any-return]
        from kvfail.vllm_stats import KVFailStats, quarantine_gauges

        peers = frozenset(quarantine.loads_by_peer())
        data = quarantine_gauges(
            quarantine, self._kvfail_refused_loads, self._kvfail_peers_sent - peers
        )
        ours = KVFailStats(data=data)
        self._kvfail_levels_sent = levels
        self._kvfail_peers_sent = peers
        self._kvfail_refused_loads = 0
        return ours if stats is None else stats.aggregate(ours)
