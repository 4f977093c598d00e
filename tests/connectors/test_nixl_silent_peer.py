"""A real silent peer: P is SIGSTOPped after the handshake, D's READ sits in ``PROC``.

The second test makes the side channel the only sign of P's end: D reached P's side
channel through a proxy, the proxy stops listening while P is stopped (so UCX sees
nothing), and D's probe must fail the load at ``peer_lost`` with the READ still in
``PROC``, hold its blocks, and give them back only once killing P has ended the READ.

Why: upstream's D has no deadline for a transfer stuck in ``PROC``; it holds the request
and its blocks until P really dies. Here D runs
KvfailNixlConnector with ``kvfail_deadline_s=5``: the watchdog must fail the load, and the
fence must release (cancel) the real NIXL handle before the blocks are handed back. If
NIXL refuses to cancel, the request must stay held until P is killed, then be reported.

Two engine processes (P and D, each ending with ``os._exit`` because of the nixl teardown
segfault), real nixl/UCX over 127.0.0.1, no test doubles. D is paused between the handshake
and the READ without stepping it: the handshake runs in upstream's background thread, and
the READ is only posted by the next ``start_load_kv``. ~40-90 s (two vLLM imports).
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

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
pytest.importorskip("nixl", reason="nixl is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Long enough that the handshake (0.1 s idle, seconds under load) ends well before it.
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
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline().strip() if ready else ""


def _d_main(params_json: str) -> None:
    result: dict[str, Any] = {}
    try:
        from vllm.v1.request import RequestStatus

        import kvfail.harness as h

        engine = h.Engine(_spec("consumer", "D-silent"))
        worker = engine.workers[0].connector.connector_worker
        engine.add_request(
            "D-req", prompt_seed="shared", kv_transfer_params=json.loads(params_json)
        )
        tracked_at = time.monotonic()
        engine.step()  # schedules the load; upstream starts the handshake in a thread
        end = time.monotonic() + 30
        while P_ENGINE not in worker._remote_agents and time.monotonic() < end:
            time.sleep(0.01)
        result["handshaked"] = P_ENGINE in worker._remote_agents
        result["handshake_s"] = time.monotonic() - tracked_at
        result["read_posted_before_pause"] = bool(worker._recving_transfers.get("D-req"))
        _emit("HANDSHAKED", result["handshaked"])
        result["go"] = _wait_line(sys.stdin, 30)

        handles_seen = [0]

        def settled(e: Any) -> bool:
            # The READ posted to the stopped P must be outstanding (PROC) until fenced.
            handles = len(worker._recving_transfers.get("D-req", []))
            handles_seen[0] = max(handles_seen[0], handles)
            if handles:  # after how many D steps the READ was seen outstanding
                result.setdefault("read_first_seen", e.record.steps)
                result["read_last_seen"] = e.record.steps
            return e.status("D-req") not in (
                RequestStatus.WAITING_FOR_REMOTE_KVS,
                RequestStatus.WAITING,
            )

        run = engine.run_until(settled, max_steps=10**6, timeout_s=8, poll_s=0.02)
        result["phase1"] = {"ok": run.ok, "reason": run.reason, "steps": run.steps}
        result["max_handles"] = handles_seen[0]
        result["handles_after_phase1"] = len(worker._recving_transfers.get("D-req", []))
        if not run.ok:  # NIXL refused to cancel: held; now kill P for real
            _emit("HELD", True)
            _wait_line(sys.stdin, 30)
            run = engine.run_until(settled, max_steps=10**6, timeout_s=15, poll_s=0.02)
            result["phase2"] = {"ok": run.ok, "reason": run.reason, "steps": run.steps}
        reports = engine.record.scheduler_reports()
        result["failed_step"] = next(
            (r.step for r in reports if "D-req" in r.failed_requests), None
        )
        result["status"] = str(engine.status("D-req"))
        result["finished"] = sum("D-req" in r.finished_recving for r in reports)
        result["failed"] = sum("D-req" in r.failed_requests for r in reports)
        result["stats"] = worker.failure_stats().as_dict()
        result["blocks_untouched"] = all(
            int(t.abs().sum()) == 0 for t in engine.workers[0].kv_caches.values()
        )
        engine.close()
    except BaseException as exc:
        import traceback

        result["error"] = repr(exc) + traceback.format_exc()[-3000:]
    _emit("RESULT", result)
    os._exit(0)


def _d_probe_main(params_json: str) -> None:
    """D for the probe test: each phase waits for the test's go-ahead on stdin."""
    result: dict[str, Any] = {}
    try:
        from vllm.v1.request import RequestStatus

        import kvfail.harness as h

        engine = h.Engine(_spec("consumer", "D-probe", PROBE_TEST_DEADLINE_S))
        worker = engine.workers[0].connector.connector_worker
        pool = engine.scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        engine.add_request(
            "D-req", prompt_seed="shared", kv_transfer_params=json.loads(params_json)
        )
        engine.step()
        end = time.monotonic() + 30
        while P_ENGINE not in worker._remote_agents and time.monotonic() < end:
            time.sleep(0.01)
        _emit("HANDSHAKED", P_ENGINE in worker._remote_agents)
        _wait_line(sys.stdin, 30)  # P is stopped now

        def handles(_: Any = None) -> int:
            return len(worker._recving_transfers.get("D-req", []))

        run = engine.run_until(lambda e: handles() > 0, max_steps=200, timeout_s=10, poll_s=0.02)
        _emit("READ", handles())
        _wait_line(sys.stdin, 30)  # the side channel refuses now
        at_failure: list[int] = []

        def failed(e: Any) -> bool:
            reported = any("D-req" in r.failed_requests for r in e.record.scheduler_reports())
            if reported and not at_failure:
                at_failure.append(handles())
            return reported and e.status("D-req") != RequestStatus.WAITING_FOR_REMOTE_KVS

        run = engine.run_until(failed, max_steps=10**6, timeout_s=20, poll_s=0.02)
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
        result["stats"] = worker.failure_stats().as_dict()
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
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        UCX_TLS="tcp,self",
        UCX_NET_DEVICES="lo",
        NIXL_LOG_LEVEL="WARN",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(_free_port()),
    )


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


def test_a_stopped_peer_is_fenced_and_reported_by_the_watchdog() -> None:
    p = _spawn("P")
    d: subprocess.Popen[str] | None = None
    try:
        params = _expect(p, "PARAMS", 240)
        d = _spawn("D", json.dumps(params))
        assert d.stdin is not None
        assert _expect(d, "HANDSHAKED", 240) is True
        os.kill(p.pid, signal.SIGSTOP)
        d.stdin.write("GO\n")
        d.stdin.flush()
        assert d.stdout is not None
        line = _wait_line(d.stdout, 30)
        if line.startswith("HELD"):
            p.kill()  # the peer really dies: the held transfer must now fail
            d.stdin.write("KILLED\n")
            d.stdin.flush()
            line = _wait_line(d.stdout, 40)
        assert line.startswith("RESULT "), line
        result = json.loads(line.removeprefix("RESULT "))
    finally:
        _kill(p)
        if d is not None:
            _kill(d)
    assert "error" not in result, result["error"]
    if result["handshake_s"] > DEADLINE_S - 1:
        pytest.skip(f"handshake took {result['handshake_s']:.1f}s: too slow to pause before it")
    assert result["handshaked"] and not result["read_posted_before_pause"], result
    assert result["status"] == "FINISHED_ERROR", result
    assert result["finished"] == 1 and result["failed"] == 1, result
    assert result["max_handles"] >= 1, result  # a real READ was stuck in PROC
    assert result["stats"]["stage.watchdog"] == 1, result
    assert result["blocks_untouched"], result
    if "phase2" in result:  # NIXL could not cancel: held until P died (C11)
        assert result["stats"]["fence_deferred"] >= 1, result
    else:
        # The READ stayed in PROC from its post up to the very step whose report failed it.
        assert result["read_first_seen"] <= result["failed_step"], result
        assert result["read_last_seen"] == result["failed_step"], result
        assert result["handles_after_phase1"] == 0, result  # released (cancelled) by the fence


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_a_gone_side_channel_fails_the_load_and_holds_its_blocks_until_the_read_ends() -> None:
    from kvfail.faults.proxy import FaultProxy

    p = _spawn("P")
    d: subprocess.Popen[str] | None = None
    proxy: FaultProxy | None = None
    try:
        params = _expect(p, "PARAMS", 240)
        proxy = FaultProxy(int(params["remote_port"]), name="side-channel").start()
        params["remote_port"] = proxy.port
        d = _spawn("D-probe", json.dumps(params))
        assert _expect(d, "HANDSHAKED", 240) is True
        os.kill(p.pid, signal.SIGSTOP)  # UCX's connection stays open, and silent
        _send(d, "GO")
        read_handles = _expect(d, "READ", 30)
        proxy.refuse()  # nothing listens where P's side channel was
        _send(d, "REFUSED")
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
    assert read_handles >= 1, result  # a real READ was posted to the stopped P
    assert result["failed_run"]["ok"], result
    at_failure = result["stats_at_failure"]
    assert at_failure.get("stage.peer_lost") == 1, result  # the probe, not UCX or the deadline
    assert not at_failure.get("stage.watchdog") and not at_failure.get("stage.transfer"), result
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
    elif sys.argv[1] == "D-probe":
        _d_probe_main(sys.argv[2])
    else:
        _d_main(sys.argv[2])
