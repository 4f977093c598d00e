"""KvfailNixlConnector's D side, run for real: upstream's NIXL pull worker, real nixl/UCX.

Why a subprocess: any process that created a nixl UCX agent segfaults at interpreter exit
(see ``kvfail.peers.nixl``), so the child ends with ``os._exit``. One child runs every
scenario in order, to pay vLLM's import once:

1. watchdog: a zmq ROUTER on 127.0.0.1 that never answers the handshake. Upstream would
   report only after its 5 s ``RCVTIMEO``; with ``kvfail_deadline_s=2`` from extra config
   the load must be reported failed by the watchdog while that handshake still waits,
   once, and the handshake's own late failure must be refused (counted, never reported a
   second time).
2. handshake: a closed side-channel port; upstream's handshake fails after 5 s and must be
   reported exactly once (finished + failed blocks), stage handshake.
3. fence: a load whose NIXL handle cannot be released. The handle and its release are a
   test double at the transport boundary (a wrapper around the real nixl agent that
   answers for one fake handle only); everything else is the real worker. The request
   must stay undelivered while the release fails, and be delivered failed once it works.
4. retained ERR handle: upstream's own ``transfer_failed`` path with a failing release
   (same double): held while retained, then reported once, stage transfer.
5. invalid peer: upstream refuses the read during its invalid-peer backoff without a
   failure log line; reported in the step that starts the load, stage peer_lost.
6. two full-attention KV-cache groups, on this connector and on upstream's: ours fails
   the request by id; upstream reports group-0 block ids and the engine crashes.

The child's whole run takes ~30-60 s (mostly the import, plus the 5 s handshake timeout),
hence ``slow``. ``test_nixl_stats.py`` holds the fast in-process checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.transports import nixl_child_env, require_transport

require_transport("nixl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 2.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- child


def _params(port: int, engine: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine,
        "remote_request_id": f"p-{engine}",
        "remote_block_ids": [[1, 2, 3]],
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": 100,
    }


def _reports_for(engine: Any, req_id: str) -> dict[str, Any]:
    """What the scheduler received about ``req_id`` (harness records, after aggregation)."""
    reports = engine.record.scheduler_reports()
    return {
        "finished": sum(req_id in r.finished_recving for r in reports),
        "failed": sum(req_id in r.failed_requests for r in reports),
        "invalid_blocks": sorted({b for r in reports for b in r.invalid_block_ids}),
    }


def _run_scenario(engine: Any, req_id: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Step until the request leaves the load; what it ended as, and in which step."""
    from vllm.v1.request import RequestStatus

    worker = engine.workers[0].connector.connector_worker
    waiting = (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
    at_settle: dict[str, Any] = {}

    def settled(e: Any) -> bool:
        if e.status(req_id) in waiting:
            return False
        # Upstream's handshakes still pending when the scheduler had its answer.
        at_settle.setdefault("handshakes_pending", len(worker._handshake_futures))
        return True

    engine.add_request(req_id, kv_transfer_params=_params(port, f"P-{req_id}"))
    run = engine.run_until(settled, max_steps=100_000, timeout_s=timeout_s, poll_s=0.02)
    engine.run_until_idle(max_steps=1000, timeout_s=10, poll_s=0.0)
    starts = engine.record.load_start_steps(req_id)
    named = [
        r.step
        for r in engine.record.scheduler_reports()
        if req_id in r.finished_recving | r.failed_requests
    ]
    return {
        "ok": run.ok,
        "reason": run.reason,
        "status": str(engine.status(req_id)),
        # D steps from the one that started the load to the first report (0: the same).
        "report_steps": named[0] - starts[0] if starts and named else None,
        **at_settle,
        **_reports_for(engine, req_id),
    }


def _fence_scenarios(worker: Any) -> dict[str, Any]:
    """White-box, worker only: the scheduler never knew these ids, so no engine steps."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta

    stuck, errored = object(), object()  # stand-ins for nixl_xfer_handle

    class FlakyRelease:
        """The real agent, except for the two fake handles (the transport double)."""

        def __init__(self, real: Any) -> None:
            self.real = real
            self.fail_release = True
            self.in_flight = True  # the stuck READ's reply has not landed yet
            self.releases = 0
            self.released_in_flight = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def check_xfer_state(self, handle: Any) -> str:
            if handle is stuck:
                return "PROC" if self.in_flight else "DONE"
            if handle is errored:
                return "ERR"
            return str(self.real.check_xfer_state(handle))

        def get_xfer_telemetry(self, handle: Any) -> Any:
            return None if handle is stuck else self.real.get_xfer_telemetry(handle)

        def release_xfer_handle(self, handle: Any) -> None:
            if handle is stuck or handle is errored:
                self.releases += 1
                self.released_in_flight += handle is stuck and self.in_flight
                if self.fail_release:
                    raise RuntimeError("NIXL_ERR_REPOST_ACTIVE (test double)")
                return
            self.real.release_xfer_handle(handle)

    def start(req_id: str, handle: object, blocks: list[int], deadline: float | None) -> None:
        worker._recving_metadata[req_id] = ReqMeta(
            local_block_ids=[blocks], local_physical_block_ids=[blocks], tp_size=1
        )
        worker._recving_transfers[req_id].append(handle)
        worker.track_load(req_id, [blocks], deadline_s=deadline)

    def step() -> tuple[set[str], set[int]]:
        results = worker.get_transfer_results()
        failed.update(results.failed_recving)
        notice = worker.take_quarantine_notice()  # after the drain, as the runner does
        notices["held"].update(r for r, _ in notice.held)
        notices["released"].update(r for r, _ in notice.released)
        return set(results.finished_recving), worker.get_block_ids_with_load_errors()

    failed: set[str] = set()
    notices: dict[str, set[str]] = {"held": set(), "released": set()}

    real, flaky = worker.nixl_wrapper, FlakyRelease(worker.nixl_wrapper)
    worker.nixl_wrapper = flaky
    out: dict[str, Any] = {}
    try:
        start("fence", stuck, [7, 8], 0.3)
        start("err", errored, [9, 10], None)
        held: list[bool] = []
        finished_while_held: list[str] = []
        for _ in range(4):  # past the deadline, the release keeps failing
            time.sleep(0.15)
            done, invalid = step()
            finished_while_held += sorted(done)
            held.append(not invalid and "fence" in worker._recving_transfers)
        # Reported at its deadline (request-level), its handle and blocks still held.
        out["finished_while_held"] = finished_while_held
        out["failed_while_held"] = sorted(failed)
        out["notices_while_held"] = {k: sorted(v) for k, v in notices.items()}
        out["held_while_release_fails"] = all(held)
        out["err_held"] = "err" in worker._recving_transfers
        out["releases_tried"] = flaky.releases
        out["stats_while_held"] = worker.failure_stats().as_dict()
        out["released_in_flight"] = flaky.released_in_flight
        flaky.fail_release = False
        # Still in flight: a release would now succeed, but nothing may free the blocks.
        time.sleep(0.15)
        done, invalid = step()
        delivered: list[tuple[list[str], list[int]]] = [(sorted(done), sorted(invalid))]
        out["held_while_in_flight"] = (
            "fence" not in done
            and not set(invalid) & {7, 8}
            and not notices["released"]
            and "fence" in worker._recving_transfers
        )
        flaky.in_flight = False  # the late reply lands; the READ is DONE
        time.sleep(0.15)
        for _ in range(3):
            done, invalid = step()
            delivered.append((sorted(done), sorted(invalid)))
            time.sleep(0.15)
        out["delivered"] = delivered
        out["notices"] = {k: sorted(v) for k, v in notices.items()}
        out["upstream_state_left"] = sorted(
            set(worker._recving_metadata) | set(worker._recving_transfers)
        )
        out["stats_after"] = worker.failure_stats().as_dict()
    finally:
        worker.nixl_wrapper = real
    return out


def _two_groups(h: Any, **connector: Any) -> dict[str, Any]:
    """Two full-attention KV-cache groups, one failed load (invalid-peer path, instant).

    Upstream keys its HMA handling on a non-full-attention layer, not on the group count,
    so here it reports group-0 block ids, which vLLM refuses with several groups.
    """
    from vllm.v1.request import RequestStatus

    engine = h.Engine(h.EngineSpec(engine_id="D-groups", num_kv_cache_groups=2, **connector))
    worker = engine.workers[0].connector.connector_worker
    worker._invalid_remote_engines.add("P-groups")
    worker._invalid_engine_backoff["P-groups"] = (60.0, time.perf_counter() + 60.0)
    params = {**_params(9, "P-groups"), "remote_block_ids": [[1, 2, 3], [1, 2, 3]]}
    engine.add_request("grouped", kv_transfer_params=params)
    waiting = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS)
    engine.run_until(lambda e: e.status("grouped") not in waiting, timeout_s=10, poll_s=0.02)
    reports = engine.record.scheduler_reports()
    out = {
        "status": str(engine.status("grouped")),
        "failed_recving": sum("grouped" in r.failed_recving for r in reports),
        "invalid_blocks": sorted({b for r in reports for b in r.invalid_block_ids}),
        "crashes": [c.message[:200] for c in engine.record.crashes],
    }
    with contextlib.suppress(Exception):
        engine.close()
    return out


def _child_main(silent_port: int, closed_port: int) -> None:
    result: dict[str, Any] = {}
    try:
        import zmq

        import kvfail.harness as h
        from kvfail.harness import oracles

        engine = h.Engine(
            h.EngineSpec(
                connector="KvfailNixlConnector",
                connector_module="connectors.nixl",
                engine_id="D-kvfail",
                extra_config={"kvfail_deadline_s": DEADLINE_S},
            )
        )
        conn = engine.workers[0].connector
        worker = conn.connector_worker
        result["classes"] = [type(conn).__name__, type(worker).__name__]
        result["deadline"] = worker.failure_reporter.default_deadline_s
        stats: list[dict[str, Any]] = []
        upstream_stats = conn.get_kv_connector_stats

        def spy() -> Any:  # observe what the model runner ships each step
            out = upstream_stats()
            if out is not None:
                stats.append({"type": type(out).__name__, **out.data})
            return out

        conn.get_kv_connector_stats = spy
        engine.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): conn.get_handshake_metadata()}
        )

        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)  # accepts the handshake, never answers
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{silent_port}")
        try:
            result["watchdog"] = _run_scenario(engine, "silent", silent_port, 20)
            # Let the abandoned handshake fail (5 s RCVTIMEO) so its late report is seen.
            engine.run_until(
                lambda e: not worker._handshake_futures, max_steps=10**6, timeout_s=10, poll_s=0.02
            )
            for _ in range(5):
                engine.step(force=True)
        finally:
            router.close()
            ctx.term()
        worker.failure_reporter.default_deadline_s = 60.0  # let the 5 s timeout win
        result["handshake"] = _run_scenario(engine, "closed", closed_port, 30)
        # Upstream's invalid-peer backoff: the read is refused without a failure log line,
        # so only the _handle_failed_transfer override can name the stage.
        worker._invalid_remote_engines.add("P-invalid")
        worker._invalid_engine_backoff["P-invalid"] = (60.0, time.perf_counter() + 60.0)
        result["invalid"] = _run_scenario(engine, "invalid", closed_port, 10)
        worker._invalid_remote_engines.discard("P-invalid")
        worker._invalid_engine_backoff.pop("P-invalid", None)
        result["violations"] = oracles.check_all(engine, failed=True)
        result["stats"] = stats
        result["fence"] = _fence_scenarios(worker)
        engine.close()
        result["two_groups"] = {
            name: _two_groups(h, **spec)
            for name, spec in (
                (
                    "kvfail",
                    {"connector": "KvfailNixlConnector", "connector_module": "connectors.nixl"},
                ),
                ("upstream", {"connector": "NixlConnector", "connector_module": None}),
            )
        }
    except BaseException as exc:
        import traceback

        result["error"] = repr(exc) + traceback.format_exc()[-3000:]
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    env = nixl_child_env(_free_port(), PYTHONPATH=str(ROOT))
    args = [sys.executable, __file__, str(_free_port()), str(_free_port())]
    done = subprocess.run(args, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    assert "error" not in result, result["error"]
    return result


def _stat(child: dict[str, Any], key: str) -> int:
    return sum(
        int(s.get(key, 0)) if not isinstance(s.get(key), list) else len(s[key])
        for s in child["stats"]
    )


def test_loads_as_upstreams_worker_with_the_deadline_from_extra_config(child: dict) -> None:
    assert child["classes"] == ["KvfailNixlConnector", "KvfailNixlWorker"]
    assert child["deadline"] == DEADLINE_S


def test_silent_peer_is_failed_by_the_watchdog_within_the_deadline(child: dict) -> None:
    run = child["watchdog"]
    assert run["ok"] and run["status"] == "FINISHED_ERROR", run
    # kvfail's deadline, not upstream's 5 s handshake timeout, ended the load.
    assert run["handshakes_pending"] == 1, run
    assert run["finished"] == 1 and run["failed"] == 1 and run["invalid_blocks"], run
    assert _stat(child, "kvfail.stage.watchdog") == 1
    # The handshake's own failure arrived after delivery: refused, not re-reported.
    assert _stat(child, "kvfail.late_reports") >= 1


def test_closed_side_channel_is_a_handshake_failure_reported_once(child: dict) -> None:
    run = child["handshake"]
    assert run["ok"] and run["status"] == "FINISHED_ERROR", run
    assert run["finished"] == 1 and run["failed"] == 1 and run["invalid_blocks"], run
    assert _stat(child, "kvfail.stage.handshake") == 1
    assert child["violations"] == []


def test_a_read_refused_for_an_invalid_peer_is_reported_as_peer_lost(child: dict) -> None:
    run = child["invalid"]
    assert run["ok"] and run["status"] == "FINISHED_ERROR", run
    assert run["finished"] == 1 and run["failed"] == 1, run
    assert run["report_steps"] == 0, run  # refused at once: in the step that starts the load
    assert _stat(child, "kvfail.stage.peer_lost") == 1


def test_stats_carry_upstream_and_kvfail_counters_in_one_object(child: dict) -> None:
    assert {s["type"] for s in child["stats"]} == {"KvfailNixlStats"}
    assert _stat(child, "num_failed_handshakes") == 2  # silent + closed, upstream's count
    assert _stat(child, "kvfail.loads_failed") == 3


def test_an_overdue_read_is_reported_at_its_deadline_and_held_while_in_flight(child: dict) -> None:
    """Fail fast, free safely: the overdue READ is reported once, by request id, while
    its handle (and so its blocks, in the scheduler half) stays held. A READ still in
    PROC is never released (a release does not stop a reply already on its way), even
    when NIXL would accept the release."""
    fence = child["fence"]
    assert fence["finished_while_held"] == ["fence"], fence
    assert fence["failed_while_held"] == ["fence"], fence
    assert fence["notices_while_held"] == {"held": ["fence"], "released": []}, fence
    assert fence["held_while_release_fails"], fence
    assert fence["err_held"], fence  # no deadline: held by its own pending handle
    assert fence["released_in_flight"] == 0, fence
    assert fence["held_while_in_flight"], fence
    held = fence["stats_while_held"]
    assert held["stage.watchdog"] >= 1 and held["loads_quarantined"] == 1, held
    assert held["loads_succeeded"] == 0


def test_once_released_the_blocks_go_back_and_nothing_is_reported_twice(child: dict) -> None:
    fence = child["fence"]
    finished = [rid for done, _ in fence["delivered"] for rid in done]
    invalid = [b for _, blocks in fence["delivered"] for b in blocks]
    assert finished == ["err"], fence
    assert sorted(invalid) == [9, 10], fence
    assert fence["notices"]["released"] == ["fence"], fence
    assert fence["upstream_state_left"] == []
    assert fence["stats_after"]["stage.transfer"] >= 1


def test_two_kv_cache_groups_are_failed_by_request_id(child: dict) -> None:
    ours = child["two_groups"]["kvfail"]
    assert ours["crashes"] == [] and ours["status"] == "FINISHED_ERROR", ours
    assert ours["failed_recving"] == 1 and ours["invalid_blocks"] == [], ours


def test_upstream_crashes_the_engine_on_the_same_two_group_failure(child: dict) -> None:
    """Documents the gap this connector closes (vLLM 0.32.0); update if upstream fixes it."""
    upstream = child["two_groups"]["upstream"]
    assert upstream["invalid_blocks"], upstream
    assert any("multiple KV cache groups" in c for c in upstream["crashes"]), upstream


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
