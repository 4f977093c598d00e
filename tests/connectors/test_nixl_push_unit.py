"""KvfailNixlPushWorker's D-side rules, in process, without a NIXL agent.

Why: the real-pair tests (``tests/peers/test_nixl_push.py``) show the whole path once per
fault; these pin each rule the hold depends on, fast, with a fake clock and upstream's
send replaced at its class (a recorder, no network):

* a load fenced at its deadline before its registration went out frees its blocks, and
  its registration is never sent afterwards (a handshake that ends late);
* a load whose registration went out is reported at the deadline but held; P's
  completion notification is taken from upstream's queue, counted as late (never passed
  on) and releases it;
* P's side channel refusing connections releases it too; a listening one does not.
"""

from __future__ import annotations

import queue
import socket
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from connectors.nixl.push import KvfailNixlPushWorker

pytestmark = pytest.mark.vllm

DEADLINE_S = 1.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Registrations upstream's send was asked for (recorded, nothing sent)."""
    calls: list[str] = []

    def record(self: Any, req_id: str, reg_data: dict[str, Any]) -> None:
        calls.append(req_id)

    monkeypatch.setattr(NixlPushConnectorWorker, "_do_send_reg_notif", record)
    return calls


def _worker(clock: _Clock) -> Any:
    w: Any = object.__new__(KvfailNixlPushWorker)
    w._init_push_state()
    w.tp_rank = 0
    w.world_size = 1
    w.transfer_topo = object()
    w._recving_metadata = {}
    w.consumer_notification_counts_by_req = defaultdict(int)
    w._pending_completion_notifs = queue.Queue()
    w.init_failure_reporter(
        num_kv_cache_groups=1,
        default_deadline_s=DEADLINE_S,
        request_level_channel=True,
        quarantine=True,
        clock=clock,
    )
    return w


def _load(w: Any, req_id: str, port: int) -> None:
    w.track_load(req_id, [[3, 4, 5]])
    remote = SimpleNamespace(host="127.0.0.1", port=port, engine_id="P")
    w._recving_metadata[req_id] = SimpleNamespace(local_block_ids=[[3, 4, 5]], remote=remote)


def _past_deadline(w: Any, clock: _Clock) -> Any:
    clock.now += DEADLINE_S + 0.1
    return w.drain_step()


def test_fenced_before_the_registration_went_out_never_sends_it(sent: list[str]) -> None:
    clock = _Clock()
    w = _worker(clock)
    _load(w, "r", _closed_port())
    report = _past_deadline(w, clock)
    # Fenced, one KV-cache group: reported by its blocks, which go back at once.
    assert "r" in report.finished_recving and report.invalid_block_ids == {3, 4, 5}
    assert w.take_quarantine_notice().held == set()  # nothing held: P never heard of it
    w._do_send_reg_notif("r", {})  # a handshake that ended after the deadline
    assert sent == []


def test_sent_load_is_held_until_ps_late_notification(sent: list[str]) -> None:
    clock = _Clock()
    w = _worker(clock)
    with socket.socket() as listener:  # P's side channel, alive
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _load(w, "r", int(listener.getsockname()[1]))
        w._do_send_reg_notif("r", {})
        assert sent == ["r"]
        report = _past_deadline(w, clock)
        assert "r" in report.failed_recving  # reported at once, request-level
        assert w.take_quarantine_notice().held == {("r", 0)}
        for _ in range(5):  # a live P that has not written: held, drain after drain
            clock.now += 1.0
            w.drain_step()
            time.sleep(0.02)
            assert w.failure_reporter.is_quarantined("r")
        heartbeats: list[str] = []
        w._handle_heartbeat = heartbeats.append  # upstream's, recorded
        w._pending_completion_notifs.put(b"HB:other")
        w._pending_completion_notifs.put(b"r:1")  # P's WRITE completed, late
        assert w._get_new_notifs() == set()
    assert heartbeats == ["other"]  # only the late notification was kept from upstream
    assert w.kvfail_late_notifications == 1
    assert w.failure_stats().as_dict()["late_reports"] == 1
    report = w.drain_step()
    assert "r" not in report.finished_recving  # never passed to the scheduler again
    assert w.take_quarantine_notice().released == {("r", 0)}


def test_sent_load_is_released_once_ps_side_channel_refuses(sent: list[str]) -> None:
    clock = _Clock()
    w = _worker(clock)
    _load(w, "r", _closed_port())
    w._do_send_reg_notif("r", {})
    _past_deadline(w, clock)
    assert w.take_quarantine_notice().held == {("r", 0)}
    end = time.monotonic() + 10.0
    while w.failure_reporter.is_quarantined("r"):
        assert time.monotonic() < end, "P's refused side channel never released the hold"
        clock.now += 1.0
        w.drain_step()
        time.sleep(0.05)
    assert w.take_quarantine_notice().released == {("r", 0)}
    assert w.kvfail_late_notifications == 0
