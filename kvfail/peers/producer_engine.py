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

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvfail.peers.protocol import Handler, dispatch

if TYPE_CHECKING:
    from kvfail.harness import Engine, EngineSpec
    from kvfail.harness.hooks import SplitForward

__all__ = ["PREFILL_TIMEOUT_S", "ProducerEngine", "pattern_forward", "producer_spec"]

#: Bound on one prefill command, however many requests it carries, on an idle machine: P
#: prefills a batch that fits its blocks in one or two steps, and waits past that only
#: for blocks its earlier requests still hold. A command may carry its own bound
#: (``timeout_s``: the suite's, stretched for a loaded machine).
PREFILL_TIMEOUT_S = 20.0


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
    """A P process's engine, its counters and its prefill commands; subclasses build
    :attr:`engine`, call :meth:`_init_counters` and say how a request is started, when it
    is prefilled and how P steps (:meth:`_start_prefill`, :meth:`_prefilled`,
    :meth:`_prefill_step`)."""

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

    def _start_prefill(self, req: Mapping[str, Any]) -> None:
        """Add P's half of one request (``req_id``, ``prompt_seed``, ``prompt_len``, and
        what the transport reads) to the engine."""
        raise NotImplementedError

    def _prefilled(self, req_id: str) -> dict[str, Any] | str | None:
        """The ``kv_transfer_params`` D needs once ``req_id`` is prefilled; a string: why
        it ended without them; None: not yet."""
        raise NotImplementedError

    def _prefill_step(self) -> None:
        """One step of P's engine while prefills are pending."""
        raise NotImplementedError

    def prefill_batch(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """``{"cmd": "prefill_batch", "requests": [{"req_id", "prompt_seed"?,
        "prompt_len"?, ...}]}``: add every request, then step until all are prefilled;
        replies ``kv_transfer_params`` by request id; ``timeout_s``: the bound, if not
        :data:`PREFILL_TIMEOUT_S`.

        Why one command for many: the engine prefills them in the same steps, so a batch
        costs P one round trip and a step or two, not one of each per request. Bounded by
        :data:`PREFILL_TIMEOUT_S` for the whole batch; any request that fails fails the
        command (the ones still pending count as failed prefills)."""
        requests = [dict(req) for req in cmd.get("requests") or ()]
        for req in requests:
            self._start_prefill(req)
        pending = [str(req["req_id"]) for req in requests]
        params: dict[str, dict[str, Any]] = {}
        bound = float(cmd.get("timeout_s") or PREFILL_TIMEOUT_S)
        deadline = time.monotonic() + bound
        while True:
            for req_id in list(pending):
                done = self._prefilled(req_id)
                if isinstance(done, str):
                    return self._prefill_failed(pending, done)
                if done is not None:
                    pending.remove(req_id)
                    params[req_id] = done
                    self.prefills += 1
            if not pending:
                return {"ok": True, "kv_transfer_params": params}
            if self.engine.crashed is not None:
                return self._prefill_failed(pending, f"P crashed: {self.engine.crashed.message}")
            if time.monotonic() >= deadline:
                error = f"prefill of {pending} not done in {bound:g} s"
                return self._prefill_failed(pending, error)
            self._prefill_step()

    def prefill(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """``{"cmd": "prefill", "req_id", ...}``: a batch of one (see
        :meth:`prefill_batch`), replied with its ``req_id``."""
        reply = self.prefill_batch({"requests": [cmd]})
        if not reply["ok"]:
            return reply
        req_id = str(cmd["req_id"])
        return {
            "ok": True,
            "req_id": req_id,
            "kv_transfer_params": reply["kv_transfer_params"][req_id],
        }

    def _prefill_failed(self, pending: list[str], error: str) -> dict[str, Any]:
        self.failed_prefills += len(pending)
        return {"ok": False, "error": error}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to one protocol command (None: quit): the commands every P answers,
        and this P's own (:meth:`_own_commands`)."""
        return dispatch(
            cmd,
            {
                "prefill": self.prefill,
                "prefill_batch": self.prefill_batch,
                "inject": self.inject,
                "stats": lambda _: self.stats(),
                **self._own_commands(),
            },
        )

    def inject(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``{"cmd": "inject", "fault": ...}``: arm a fault of this P's own."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """``{"cmd": "stats"}``: this P's counters (:meth:`_stats`, and its own)."""
        raise NotImplementedError

    def _own_commands(self) -> dict[str, Handler]:
        """Commands only this kind of P answers, by name."""
        return {}
