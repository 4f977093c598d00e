"""A real NIXL PRODUCER (P) engine in its own OS process, driven over stdin/stdout.

Why a process: a fault on P must be a real one (SIGKILL makes UCX see the endpoint die,
SIGSTOP leaves it connected and silent), and only a separate OS process gives that. Also,
any process that created a nixl UCX agent segfaults at a normal interpreter exit
(``workers-on-cpu.md``), so P always ends with ``os._exit``.

P is the harness :class:`~kvfail.harness.Engine`: vLLM's real ``Scheduler`` (whose
SCHEDULER-role NIXL connector serves the zmq side-channel handshake) and a real
WORKER-role NIXL pull connector (nixl agent, UCX over TCP loopback, DRAM KV tensors
registered with ``kv_buffer_device="cpu"``). Its forward writes :mod:`kvfail.peers.pattern`
into the request's KV blocks, so D can check every byte it pulled.

Run: ``python -m kvfail.peers.nixl_producer --config '<json>'``. Config keys (optional):
``connector`` (default ``NixlConnector``), ``connector_module`` (None = registered in
vLLM; ``connectors.nixl`` for kvfail's), ``engine_id``, ``extra_config``, ``num_blocks``.
The side-channel host/port come from ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` (set by
the parent; 127.0.0.1 and a free port).

Protocol: one JSON object per line; commands on stdin, each with an ``id`` the reply
echoes; replies on the *original* stdout prefixed with :data:`PREFIX` (fd 1 is pointed at
stderr before vLLM is imported, because NIXL's Python logger writes to stdout):

* ``{"cmd": "prefill", "req_id", "prompt_seed", "prompt_len"}``: run P's request
  (``do_remote_decode``, ``max_tokens=1``) until it finishes; reply with the
  ``kv_transfer_params`` upstream's ``request_finished`` produced for D;
* ``{"cmd": "stats"}``: counters, ``finished_sending`` seen, free blocks;
* ``{"cmd": "quit"}``: close and ``os._exit(0)``.

Between commands P keeps stepping its engine (forced, so the connector's worker side runs
even when the scheduler is idle): that is what receives D's completion notification and
reports ``finished_sending``.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvfail.peers.protocol import dispatch, serve

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvfail.harness import Engine, Worker

__all__ = ["PREFIX", "main", "restore_affinity"]

#: Every protocol line starts with this, so a reader can ignore anything else.
PREFIX = "@@kvfail-nixl-p "
#: Bound on one prefill command (P's request finishes in one step normally).
PREFILL_TIMEOUT_S = 20.0
#: P's idle loop: a forced step this often keeps notifications and lease expiry flowing.
_IDLE_STEP_S = 0.02


def restore_affinity(mask: set[int]) -> None:
    """Give every thread of this process the CPU mask it had before an engine was built.

    Why: on ``device_type == "cpu"`` vLLM's worker pins the calling thread to the last
    core of each NUMA node, and threads started later (nixl/UCX, the handshake executor)
    inherit that. Every vLLM CPU process on the machine then fights for one core, and
    a handshake thread starved past zmq's 5 s ``RCVTIMEO`` turns a good pull into a
    failure. The harness is not a real model worker; the transport needs no pinning.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except OSError:  # the thread ended meanwhile
            continue


class _Producer:
    def __init__(self, config: dict[str, Any]) -> None:
        from kvfail.harness import Engine, EngineSpec

        self.engine_id: str = config.get("engine_id") or f"P-nixl-{os.getpid()}"
        self.port = int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        self.seeds: dict[str, str] = {}
        spec = EngineSpec(
            role="producer",
            connector=config.get("connector", "NixlConnector"),
            connector_module=config.get("connector_module"),
            engine_id=self.engine_id,
            extra_config=dict(config.get("extra_config") or {}),
            num_blocks=int(config.get("num_blocks", 64)),
        )
        mask = os.sched_getaffinity(0)
        self.engine: Engine = Engine(spec, forward=self._forward)
        restore_affinity(mask)
        conn = self.engine.workers[0].connector
        sched_conn = self.engine.scheduler.connector
        assert sched_conn is not None
        # What EngineCore does after KV registration: starts the zmq side-channel listener.
        sched_conn.set_xfer_handshake_metadata_pp_aware({(0, 0): conn.get_handshake_metadata()})
        self.prefills = 0
        self.failed_prefills = 0
        self.finished_sending: list[str] = []
        self._seen_reports = 0
        self._last_step = 0.0

    def _forward(self, engine: Engine, worker: Worker, so: SchedulerOutput) -> None:
        """P's "model": write the byte pattern for every token computed this step."""
        from kvfail.peers.pattern import write_pattern

        manager = engine.scheduler.kv_cache_manager
        for req_id, n in so.num_scheduled_tokens.items():
            request = engine.scheduler.requests[req_id]
            start = request.num_computed_tokens - n  # schedule() already advanced it
            end = min(start + n, request.num_prompt_tokens)
            block_ids = manager.get_block_ids(req_id)[0]
            seed = self.seeds.get(req_id, req_id)
            for layer, name in enumerate(engine.built.layer_names):
                write_pattern(worker.kv_caches[name], layer, block_ids, start, end, seed)

    def step(self) -> None:
        if self.engine.crashed is not None:
            return
        self.engine.step(force=True)
        self._last_step = time.monotonic()
        reports = self.engine.record.kv_reports
        for report in reports[self._seen_reports :]:
            if report.rank is None:
                self.finished_sending.extend(sorted(report.finished_sending))
        self._seen_reports = len(reports)

    def idle(self) -> None:
        """Step when busy; otherwise a forced step every ``_IDLE_STEP_S``."""
        if not self.engine.is_idle() or time.monotonic() - self._last_step >= _IDLE_STEP_S:
            self.step()
        else:
            time.sleep(0.005)

    def prefill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        req_id = str(cmd["req_id"])
        self.seeds[req_id] = str(cmd.get("prompt_seed") or req_id)
        self.engine.add_request(
            req_id,
            prompt_len=int(cmd.get("prompt_len", 100)),
            prompt_seed=self.seeds[req_id],
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        deadline = time.monotonic() + PREFILL_TIMEOUT_S
        while True:
            outs = [o for o in self.engine.record.outputs_for(req_id) if o.kv_transfer_params]
            if outs:
                break
            if self.engine.crashed is not None:
                self.failed_prefills += 1
                return {"ok": False, "error": f"P crashed: {self.engine.crashed.message}"}
            if time.monotonic() >= deadline:
                self.failed_prefills += 1
                return {"ok": False, "error": f"prefill of {req_id} not done in time"}
            self.step()
        self.prefills += 1
        return {
            "ok": True,
            "req_id": req_id,
            "kv_transfer_params": dict(outs[-1].kv_transfer_params),
        }

    def stats(self) -> dict[str, Any]:
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
        }

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        return dispatch(cmd, {"prefill": self.prefill, "stats": lambda _: self.stats()})


def main(argv: list[str] | None = None) -> None:
    """Entry point; never returns (``os._exit``: the nixl teardown segfault)."""
    serve(
        argv,
        doc=__doc__,
        prefix=PREFIX,
        build=lambda config, _channel: _Producer(config),
        ready=lambda p: {"engine_id": p.engine_id, "side_channel_port": p.port},
        idle=lambda p: p.idle(),
    )


if __name__ == "__main__":
    main()
