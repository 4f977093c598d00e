"""The harness drives a real upstream worker connector (NIXL), not only the toy.

Why: the config builder's claims (LBHNC, real ``KVCacheTensor`` entries, world of one,
``kv_buffer_device="cpu"``) only matter if a real transport can register the memory and
report through the harness. Runs in a subprocess because any process that created a nixl
UCX agent segfaults at interpreter exit, so it ends with ``os._exit``. The fault is a
closed side-channel port: NIXL's handshake times out after its 5 s zmq ``RCVTIMEO`` and
reports the load as failed. Marked slow: a second vLLM import plus the timeout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.transports import nixl_child_env, require_transport

require_transport("nixl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r"""
import json, os, sys
result = {}
try:
    import kvfail.harness as h
    from kvfail.harness import oracles
    e = h.Engine(h.EngineSpec(connector="NixlConnector", connector_module=None,
                              engine_id="D-nixl"))
    w = e.workers[0].connector
    result["worker"] = type(w).__name__
    e.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): w.get_handshake_metadata()})
    e.add_request("remote", kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P-x",
        "remote_request_id": "p", "remote_block_ids": [[1, 2, 3]],
        "remote_host": "127.0.0.1", "remote_port": int(sys.argv[1]), "tp_size": 1,
        "remote_num_tokens": 100})
    run = e.run_until_idle(max_steps=5000, timeout_s=30, poll_s=0.02)
    result.update(ok=run.ok, reason=run.reason, elapsed=run.elapsed_s,
                  status=str(e.status("remote")), violations=oracles.check_all(e, failed=True))
    e.close()
except BaseException as exc:
    result["error"] = repr(exc)
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_real_nixl_worker_reports_a_failed_handshake_through_the_harness() -> None:
    env = nixl_child_env(_closed_port())
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(_closed_port())],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "error" not in result, result
    assert result["worker"] == "NixlPullConnector"
    assert result["ok"] and result["status"] == "FINISHED_ERROR", result
    assert result["violations"] == []
