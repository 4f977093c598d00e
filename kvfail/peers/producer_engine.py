"""What the rig's P processes share, whatever their transport: the engine they build from
their ``--config``, the byte pattern its forward writes, and the bookkeeping of what it
prefilled and sent.

Why a module of its own: :mod:`kvfail.peers.producer` (Mooncake) and
:mod:`kvfail.peers.nixl_producer` differ only in how P serves D and how it is faulted;
the P engine and the counters D's checks read from its ``stats`` must be the same in
both. Imported in the P process only, before any engine is built; nothing here imports
vLLM at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfail.harness import Engine, EngineSpec
    from kvfail.harness.hooks import SplitForward

__all__ = ["ProducerEngine", "pattern_forward", "producer_spec"]


def pattern_forward(seeds: Mapping[str, str]) -> SplitForward:
    """P's "model": write the byte pattern (per rank, per KV-cache group) for every
    prompt token computed this step, seeded by ``seeds[req_id]`` (read at each step, so
    the caller adds a request's seed before the request)."""
    from kvfail.harness.hooks import SplitForward
    from kvfail.peers.forwards import apply_writes, plan_writes

    return SplitForward(plan=lambda engine, so: plan_writes(engine, so, seeds), apply=apply_writes)


def producer_spec(
    config: Mapping[str, Any], *, connector: str, engine_id: str, extra_config: dict[str, Any]
) -> EngineSpec:
    """P's engine spec from its ``--config`` (``connector`` is the default connector);
    ``tp_size`` > 1 runs one process per rank."""
    from kvfail.harness import EngineSpec

    tp_size = int(config.get("tp_size", 1))
    return EngineSpec(
        role="producer",
        connector=config.get("connector", connector),
        connector_module=config.get("connector_module"),
        engine_id=engine_id,
        extra_config=extra_config,
        num_blocks=int(config.get("num_blocks", 64)),
        num_kv_cache_groups=int(config.get("num_kv_cache_groups", 1)),
        tp_size=tp_size,
        tp_mode="processes" if tp_size > 1 else "simulated",
    )


class ProducerEngine:
    """A P process's engine and its counters; subclasses build :attr:`engine` and call
    :meth:`_init_counters`."""

    engine: Engine
    engine_id: str

    def _init_counters(self) -> None:
        self.prefills = 0
        self.failed_prefills = 0
        #: Requests the engine reported in ``finished_sending`` (D told P it is done).
        self.finished_sending: list[str] = []
        self._seen_reports = 0

    def _step(self, *, force: bool = False) -> None:
        """One engine step, then the requests it reported sent."""
        self.engine.step(force=force)
        reports = self.engine.record.kv_reports
        for report in reports[self._seen_reports :]:
            if report.rank is None:
                self.finished_sending.extend(sorted(report.finished_sending))
        self._seen_reports = len(reports)

    def _stats(self, **more: Any) -> dict[str, Any]:
        """The ``stats`` reply: what every P counts, then ``more``."""
        sched = self.engine.scheduler
        return {
            "ok": True,
            "engine_id": self.engine_id,
            "steps": self.engine.record.steps,
            "prefills": self.prefills,
            "failed_prefills": self.failed_prefills,
            "finished_sending": list(self.finished_sending),
            "pending_requests": sorted(sched.requests),
            "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "crashed": None if self.engine.crashed is None else self.engine.crashed.message,
            **more,
        }
