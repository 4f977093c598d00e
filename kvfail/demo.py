"""A short, real demonstration of the mixin with vLLM's own types.

A worker adopting ``FailureReporterMixin`` receives four loads: one succeeds on both of
its peers, one gets an ERROR from its peer, one peer goes silent until the watchdog
fires, and one is a notify-only pull for a request the scheduler already dropped. Each
step's results are packed into vLLM's ``KVConnectorOutput`` exactly as the model runner
does, so what is printed is what the scheduler would receive.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def run(out: TextIO = sys.stdout, deadline_s: float = 0.3) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    import vllm
    from vllm.v1.outputs import KVConnectorOutput

    from kvfail import FailureReporterMixin, Stage
    from kvfail.vllm_stats import KVFailStats

    print(f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f}s", file=out)

    class DemoWorker(FailureReporterMixin):
        def __init__(self) -> None:
            self.init_failure_reporter(
                num_kv_cache_groups=1, name="demo", default_deadline_s=deadline_s
            )

        def get_transfer_results(self, finished_req_ids: set[str]) -> object:
            return self.transfer_results()

        def get_kv_connector_stats(self) -> KVFailStats | None:
            return KVFailStats.from_failure_stats(self.take_failure_stats())

    w = DemoWorker()
    w.track_load("req-ok", [[1, 2, 3]], peers=["p0", "p1"])
    w.track_load("req-error", [[4, 5]])
    w.track_load("req-silent", [[6, 7, 8]])
    w.track_load("req-aborted", [])  # notify-only: abort_immediately

    def step(label: str) -> None:
        res = w.get_transfer_results(set())
        output = KVConnectorOutput(
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
        )
        stats = output.kv_connector_stats.reduce() if output.kv_connector_stats else {}
        print(f"\n[{label}]", file=out)
        print(f"  finished_recving  = {sorted(output.finished_recving or ())}", file=out)
        print(f"  failed_recving    = {sorted(output.failed_recving)}", file=out)
        print(f"  invalid_block_ids = {sorted(output.invalid_block_ids)}", file=out)
        print(f"  stats             = {stats}", file=out)

    w.load_succeeded("req-ok", peer="p0")
    w.load_failed("req-error", Stage.PEER, "P answered ERROR")
    w.load_failed("req-aborted", Stage.TRANSFER, "peer refused")  # never reported
    step("step 1: p0 done, req-error failed, aborted pull settled")
    w.load_succeeded("req-ok", peer="p1")
    w.load_failed("req-error", Stage.TRANSFER, "duplicate")  # already delivered: late
    step("step 2: p1 done")
    time.sleep(deadline_s * 1.2)
    step(f"step 3: {deadline_s}s later, the silent peer's deadline has passed")
    total = w.failure_stats().as_dict()
    print("\ntotals: " + ", ".join(f"{k}={v}" for k, v in total.items() if v), file=out)
    return scheduler_part(out)


def scheduler_part(out: TextIO) -> int:
    """The same reports consumed by vLLM's real Scheduler, under both policies.

    The connector here is kvfail's ToyConnector: the mixin on a dict "transport" (a test
    double at the transport boundary); the conformance suite runs real transports.
    """
    from vllm.v1.request import RequestStatus

    from kvfail import Stage
    from kvfail.harness import Engine, EngineSpec, oracles

    print(
        "\n--- on vLLM's real Scheduler (ToyConnector: the mixin over an in-memory transport) ---",
        file=out,
    )
    worst = 0
    for policy in ("fail", "recompute"):
        spec = EngineSpec(
            role="consumer",
            policy=policy,
            engine_id=f"demo-{policy}",
            extra_config={"toy_mode": "hold"},
        )
        with Engine(spec) as engine:
            req = engine.add_request(
                "req-1",
                prompt_len=100,
                max_tokens=3,
                kv_transfer_params={"do_remote_prefill": True},
            )
            engine.step()
            waiting = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            engine.workers[0].connector.fail("req-1", block_index=1, stage=Stage.TRANSFER)
            result = engine.run_until_idle(max_steps=50, timeout_s=30.0)
            outs = engine.record.outputs_for("req-1")
            reasons = sorted({str(o.finish_reason) for o in outs if o.finish_reason})
            tokens = sum(len(o.new_token_ids) for o in outs)
            violations = oracles.check_all(engine)
            print(
                f"policy={policy:<9} waited_for_remote_kv={waiting} "
                f"steps={result.steps} final={req.status.name} finish={reasons} "
                f"tokens={tokens} oracle_violations={len(violations)}",
                file=out,
            )
            for v in violations:
                print(f"  violation: {v}", file=out)
            worst = max(worst, 1 if violations or not result.ok else 0)
    return worst
