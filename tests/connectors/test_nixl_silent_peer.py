"""A real stopped P: SIGSTOPped after the handshake, so D's READ sits in ``PROC``.

Upstream's D has no deadline for a transfer stuck in ``PROC``; it holds the request and
its blocks until P really dies. KvfailNixlConnector must report the load failed, and
hold its blocks while the READ may still write (a released UCX GET can still land its
reply), giving them back only once the READ has ended. Two ways to the report:

* its deadline (``kvfail_deadline_s=5``): stage ``watchdog``;
* P's side channel refusing connections: D reached it through a proxy, which stops
  listening while P is stopped, so the side channel is the only sign of P's end (UCX's
  connection stays open and silent): stage ``peer_lost``, well before a long deadline.

Either way the READ ends only when the test kills P, and the blocks must come back then.
Two engine processes (P and D, each ending with ``os._exit`` because of the nixl teardown
segfault), real nixl/UCX over 127.0.0.1, no test doubles. D is paused between the
handshake and the READ without stepping it: the handshake runs in upstream's background
thread, and the READ is only posted by the next ``start_load_kv``. ~40-90 s each (two
vLLM imports).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.transports import nixl_child_env, require_transport

require_transport("nixl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Long enough that the handshake (quick when idle, much slower under load) ends well before it.
DEADLINE_S = 5.0
P_ENGINE = "P-silent"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: The probe test's deadline: far past its waits, so only the probe can fail the load.
PROBE_TEST_DEADLINE_S = 300.0


def _spec(role: str, engine_id: str, deadline_s: float = DEADLINE_S) -> Any:
    import kvfail.harness as h

    return h.EngineSpec(
        role=role,
        connector="KvfailNixlConnector",
        connector_module="connectors.nixl",
        engine_id=engine_id,
        extra_config={"kvfail_deadline_s": deadline_s},
    )


def _emit(tag: str, payload: object) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


# --------------------------------------------------------------------------- children


def _p_main() -> None:
    """Prefill one request, publish its transfer params, then keep serving (bounded)."""
    try:
        import kvfail.harness as h

        engine = h.Engine(_spec("producer", P_ENGINE))
        conn = engine.workers[0].connector
        engine.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): conn.get_handshake_metadata()}
        )
        engine.add_request(
            "P-req",
            prompt_seed="shared",
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        engine.run_until(lambda e: bool(e.record.outputs_for("P-req")), timeout_s=30, poll_s=0.01)
        params = next(o.kv_transfer_params for o in engine.record.outputs_for("P-req"))
        _emit("PARAMS", params)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            engine.step(force=True)
            time.sleep(0.02)
    except BaseException as exc:
        _emit("ERROR", repr(exc))
    os._exit(0)


def _wait_line(stream: IO[str], timeout_s: float) -> str:
    # poll, not select: the pytest process may hold descriptors numbered past 1024.
    poller = select.poll()
    poller.register(stream, select.POLLIN)
    ready = poller.poll(max(0, int(timeout_s * 1000)))
    return stream.readline().strip() if ready else ""


def _d_main(params_json: str, mode: str) -> None:
    """D: each phase waits for the test's go-ahead on stdin. ``mode`` is ``watchdog``
    (a 5 s deadline ends the load) or ``probe`` (a deadline far past every wait)."""
    result: dict[str, Any] = {}
    try:
        from vllm.v1.request import RequestStatus

        import kvfail.harness as h

        deadline_s = DEADLINE_S if mode == "watchdog" else PROBE_TEST_DEADLINE_S
        engine = h.Engine(_spec("consumer", f"D-{mode}", deadline_s))
        worker = engine.workers[0].connector.connector_worker
        pool = engine.scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        engine.add_request(
            "D-req", prompt_seed="shared", kv_transfer_params=json.loads(params_json)
        )
        tracked_at = time.monotonic()
        engine.step()  # schedules the load; upstream starts the handshake in a thread
        end = time.monotonic() + 30
        while P_ENGINE not in worker._remote_agents and time.monotonic() < end:
            time.sleep(0.01)
        result["handshake_s"] = time.monotonic() - tracked_at
        result["read_posted_before_pause"] = bool(worker._recving_transfers.get("D-req"))
        _emit("HANDSHAKED", P_ENGINE in worker._remote_agents)
        _wait_line(sys.stdin, 30)  # P is stopped now

        def handles() -> int:
            return len(worker._recving_transfers.get("D-req", []))

        engine.run_until(lambda e: handles() > 0, max_steps=200, timeout_s=10, poll_s=0.02)
        _emit("READ", handles())
        _wait_line(sys.stdin, 30)  # in probe mode, the side channel refuses now
        at_failure: list[int] = []

        def reported(e: Any) -> bool:
            failed = any("D-req" in r.failed_requests for r in e.record.scheduler_reports())
            if failed and not at_failure:
                at_failure.append(handles())
            return failed and e.status("D-req") != RequestStatus.WAITING_FOR_REMOTE_KVS

        run = engine.run_until(reported, max_steps=10**6, timeout_s=20, poll_s=0.02)
        result["failed_run"] = {"ok": run.ok, "reason": run.reason, "steps": run.steps}
        result["handles_at_failure"] = at_failure[0] if at_failure else None
        result["held_after_failure"] = worker.failure_reporter.quarantined_blocks
        result["stats_at_failure"] = worker.failure_stats().as_dict()
        _emit("FAILED", run.ok)
        _wait_line(sys.stdin, 30)  # P is killed now

        def released(e: Any) -> bool:
            return (
                worker.failure_reporter.quarantined_blocks == 0
                and pool.get_num_free_blocks() == free_before
            )

        run = engine.run_until(released, max_steps=10**6, timeout_s=30, poll_s=0.02)
        result["released_run"] = {"ok": run.ok, "reason": run.reason, "steps": run.steps}
        result["handles_after"] = handles()
        result["status"] = str(engine.status("D-req"))
        reports = engine.record.scheduler_reports()
        result["finished"] = sum("D-req" in r.finished_recving for r in reports)
        result["failed"] = sum("D-req" in r.failed_requests for r in reports)
        result["blocks_untouched"] = all(
            int(t.abs().sum()) == 0 for t in engine.workers[0].kv_caches.values()
        )
        engine.close()
    except BaseException as exc:
        import traceback

        result["error"] = repr(exc) + traceback.format_exc()[-3000:]
    _emit("RESULT", result)
    os._exit(0)


# --------------------------------------------------------------------------- test


def _env() -> dict[str, str]:
    return nixl_child_env(_free_port(), PYTHONPATH=str(ROOT))


def _expect(proc: subprocess.Popen[str], tag: str, timeout_s: float) -> Any:
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = _wait_line(proc.stdout, end - time.monotonic())
        if line.startswith(tag + " "):
            return json.loads(line.removeprefix(tag + " "))
        if line.startswith("ERROR ") or (not line and proc.poll() is not None):
            raise AssertionError(f"child failed waiting for {tag}: {line}")
    raise AssertionError(f"timed out waiting for {tag}")


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=10)


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.parametrize(
    ("mode", "stage"), [("watchdog", "watchdog"), ("probe", "peer_lost")], ids=["deadline", "probe"]
)
def test_a_stopped_peer_is_reported_and_its_blocks_held_until_the_read_ends(
    mode: str, stage: str
) -> None:
    from kvfail.faults.proxy import FaultProxy

    p = _spawn("P")
    d: subprocess.Popen[str] | None = None
    proxy: FaultProxy | None = None
    try:
        params = _expect(p, "PARAMS", 240)
        if mode == "probe":
            proxy = FaultProxy(int(params["remote_port"]), name="side-channel").start()
            params["remote_port"] = proxy.port
        d = _spawn("D", json.dumps(params), mode)
        assert _expect(d, "HANDSHAKED", 240) is True
        os.kill(p.pid, signal.SIGSTOP)  # UCX's connection stays open, and silent
        _send(d, "GO")
        read_handles = _expect(d, "READ", 30)
        if proxy is not None:
            proxy.refuse()  # nothing listens where P's side channel was
        _send(d, "NEXT")
        _expect(d, "FAILED", 60)
        p.kill()  # now the READ can end (in error)
        _send(d, "KILLED")
        result = _expect(d, "RESULT", 60)
    finally:
        if proxy is not None:
            proxy.close()
        _kill(p)
        if d is not None:
            _kill(d)
    assert "error" not in result, result["error"]
    if mode == "watchdog" and result["handshake_s"] > DEADLINE_S - 1:
        pytest.skip(f"handshake took {result['handshake_s']:.1f}s: too slow to pause before it")
    assert not result["read_posted_before_pause"] and read_handles >= 1, result
    assert result["failed_run"]["ok"], result
    at_failure = result["stats_at_failure"]
    others = {"watchdog", "peer_lost", "transfer", "transfer_setup"} - {stage}
    assert at_failure[f"stage.{stage}"] == 1, result
    assert not any(at_failure[f"stage.{o}"] for o in others), result
    # Reported while the READ could still write: its blocks were held, not freed.
    assert result["handles_at_failure"] >= 1 and result["held_after_failure"] > 0, result
    assert result["released_run"]["ok"], result  # given back once the READ ended
    assert result["handles_after"] == 0, result
    assert result["status"] == "FINISHED_ERROR", result
    assert result["finished"] == 1 and result["failed"] == 1, result
    assert result["blocks_untouched"], result


if __name__ == "__main__":
    if sys.argv[1] == "P":
        _p_main()
    else:
        _d_main(sys.argv[2], sys.argv[3])
