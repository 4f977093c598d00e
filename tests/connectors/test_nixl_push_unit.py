"""KvfailNixlPushWorker's D-side rules, in process, without a NIXL agent.

Why: the real-pair tests (``tests/peers/test_nixl_push.py``) show the whole path once per
fault; these pin each rule the hold depends on, fast, with a fake clock and upstream's
send replaced at its class (a recorder, no network):

* a load fenced at its deadline before its registration went out frees its blocks, and
  its registration is never sent afterwards (a handshake that ends late);
* a load whose registration went out is reported at the deadline but held; P's
  completion notification is taken from upstream's queue, counted as late (never passed
  on) and releases it;
* P's side channel refusing connections releases it only with every writer's NIXL
  endpoint reporting its process gone, at TP 1 too (a graceful shutdown closes the
  listener first); a listening side channel never does;
* a load still waiting when its P's side channel starts refusing is failed at once, not
  at its deadline, and held by the same rules.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from connectors.nixl.push import KvfailNixlPushWorker
from kvfail.peers.base import closed_port
from tests.core.fakes import ManualClock

pytestmark = pytest.mark.vllm

DEADLINE_S = 1.0


@contextlib.contextmanager
def _live_port() -> Iterator[int]:
    """The port of a P side channel that is alive (it listens) while the block runs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Registrations upstream's send was asked for (recorded, nothing sent)."""
    calls: list[str] = []

    def record(self: Any, req_id: str, reg_data: dict[str, Any]) -> None:
        calls.append(req_id)

    monkeypatch.setattr(NixlPushConnectorWorker, "_do_send_reg_notif", record)
    return calls


def _worker(clock: ManualClock) -> Any:
    w: Any = object.__new__(KvfailNixlPushWorker)
    w._init_push_state()
    w.tp_rank = 0
    w.world_size = 1
    w.transfer_topo = object()
    w._recving_metadata = {}
    w.consumer_notification_counts_by_req = defaultdict(int)
    w._pending_completion_notifs = queue.Queue()
    w._remote_agents = defaultdict(dict)  # P's rank agents, by engine id (none handshook)
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


def _past_deadline(w: Any, clock: ManualClock) -> Any:
    clock.now += DEADLINE_S + 0.1
    return w.drain_step()


def test_fenced_before_the_registration_went_out_never_sends_it(sent: list[str]) -> None:
    clock = ManualClock(100.0)
    w = _worker(clock)
    _load(w, "r", closed_port())
    report = _past_deadline(w, clock)
    # Fenced, one KV-cache group: reported by its blocks, which go back at once.
    assert "r" in report.finished_recving and report.invalid_block_ids == {3, 4, 5}
    assert w.take_quarantine_notice().held == set()  # nothing held: P never heard of it
    w._do_send_reg_notif("r", {})  # a handshake that ended after the deadline
    assert sent == []


def test_sent_load_is_held_until_ps_late_notification(sent: list[str]) -> None:
    clock = ManualClock(100.0)
    w = _worker(clock)
    with _live_port() as port:  # P's side channel, alive
        _load(w, "r", port)
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


@pytest.mark.parametrize("writer_gone", [True, False])
def test_a_refused_side_channel_ends_a_tp1_hold_only_with_its_writer_gone(
    sent: list[str], writer_gone: bool
) -> None:
    """P at TP 1: listener and writer share a process, but vLLM's graceful shutdown closes
    the listener while a WRITE may still be under way. The refusal ends the hold only once
    the writer's own NIXL endpoint says its process is gone (a refusal alone released it
    before, shutdown or not)."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    w._remote_agents["P"] = {(0, 0): "P-r0"}
    w.nixl_wrapper = _Agents({"P-r0"} if writer_gone else set())
    _load(w, "r", closed_port())
    w._do_send_reg_notif("r", {})
    _past_deadline(w, clock)
    assert w.take_quarantine_notice().held == {("r", 0)}
    end = time.monotonic() + 10.0
    for _ in range(12):  # far more refusals than the probe needs to call P gone
        assert time.monotonic() < end
        clock.now += 1.0
        w.drain_step()
        time.sleep(0.05)
        if not w.failure_reporter.is_quarantined("r"):
            break
    assert w.failure_reporter.is_quarantined("r") is not writer_gone
    assert w.take_quarantine_notice().released == ({("r", 0)} if writer_gone else set())
    assert w.kvfail_late_notifications == 0


# ------------------------------------------------ every writer, and only writers' evidence


def _load_from(w: Any, req_id: str, port: int, *, host: str = "127.0.0.1", **p: int) -> None:
    """A load from a P with the given TP/PP sizes (P's kv_transfer_params carry them)."""
    w.track_load(req_id, [[3, 4, 5]])
    remote = SimpleNamespace(host=host, port=port, engine_id="P")
    w._recving_metadata[req_id] = SimpleNamespace(
        local_block_ids=[[3, 4, 5]],
        remote=remote,
        tp_size=p.get("tp_size", 1),
        pp_size=p.get("pp_size", 1),
    )


def _held_after_deadline(w: Any, clock: ManualClock, req_id: str) -> None:
    w._do_send_reg_notif(req_id, {})
    report = _past_deadline(w, clock)
    assert req_id in report.failed_recving
    assert w.take_quarantine_notice().held == {(req_id, 0)}


def test_a_hold_waits_for_every_pipeline_stage_of_p(sent: list[str]) -> None:
    """P at PP 2 WRITEs from two stages, each with its own notification: the first must
    not end the hold while the second stage may still write (released after one of
    two before, as ``max(1, tp // world)`` ignored P's stages)."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    with _live_port() as port:
        _load_from(w, "r", port, pp_size=2)
        _held_after_deadline(w, clock, "r")
        w._pending_completion_notifs.put(b"r:1")  # stage 0's WRITE is over
        w._get_new_notifs()
        w.drain_step()
        assert w.failure_reporter.is_quarantined("r"), "released with stage 1 still writing"
        assert w.take_quarantine_notice().released == set()
        w._pending_completion_notifs.put(b"r:1")  # stage 1's
        w._get_new_notifs()
        w.drain_step()
    assert not w.failure_reporter.is_quarantined("r")
    assert w.take_quarantine_notice().released == {("r", 0)}
    assert w._kvfail_held == {}


def test_notifications_before_the_fence_count_toward_the_hold(sent: list[str]) -> None:
    """Stage 0 notified while the load still waited (upstream counted it); the fence
    keeps that count, so stage 1's late notification alone ends the hold."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    with _live_port() as port:
        _load_from(w, "r", port, pp_size=2)
        w.consumer_notification_counts_by_req["r"] = 1  # upstream's count, stage 0
        _held_after_deadline(w, clock, "r")
        w._pending_completion_notifs.put(b"r:1")
        w._get_new_notifs()
        w.drain_step()
    assert not w.failure_reporter.is_quarantined("r")


@pytest.mark.parametrize("sizes", [{"tp_size": 2}, {"pp_size": 2}])
def test_a_refused_side_channel_does_not_end_a_hold_whose_writers_are_elsewhere(
    sent: list[str], sizes: dict[str, int]
) -> None:
    """P's side channel is its scheduler's; at TP or PP > 1 its WRITEs come from worker
    processes the refusal says nothing about. The hold stays until their notifications
    (it was released at the second refusal before)."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    _load_from(w, "r", closed_port(), **sizes)
    _held_after_deadline(w, clock, "r")
    for _ in range(12):  # far more refusals than the probe needs to call P gone
        clock.now += 1.0
        w.drain_step()
        time.sleep(0.02)
        assert w.failure_reporter.is_quarantined("r")
    owed = sizes.get("pp_size", 1) * sizes.get("tp_size", 1)
    for _ in range(owed):
        w._pending_completion_notifs.put(f"r:{sizes.get('tp_size', 1)}".encode())
    w._get_new_notifs()
    w.drain_step()
    assert not w.failure_reporter.is_quarantined("r")


class nixlRemoteDisconnectError(Exception):  # named as the binding's class
    """What NIXL's binding raises for a notification to an agent whose process is gone."""


class _Agents:
    """D's NIXL agent at its one seam here, ``send_notif``: agents in ``gone`` answer as
    UCX does for a dead process. The real answer is shown over UCX by the conformance
    scenario ``test_peer_killed_after_warm_pull`` at ``tp2``/``p2d1`` with NIXL push."""

    def __init__(self, gone: set[str]) -> None:
        self.gone = gone
        self.sent: list[tuple[str, bytes]] = []

    def send_notif(self, name: str, msg: bytes) -> None:
        self.sent.append((name, msg))
        if name in self.gone:
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")


@pytest.mark.parametrize("gone", [{"P-r0", "P-r1"}, {"P-r0"}, set()])
def test_a_hold_whose_writers_are_elsewhere_ends_when_every_writer_is_disconnected(
    sent: list[str], gone: set[str]
) -> None:
    """At TP 2 the refusal alone proves nothing, but with it D asks each P rank agent it
    handshook with: only when every one is disconnected (its process gone) does the hold
    end. One still connected (alive, or stopped: its endpoint stays up) keeps it."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    w._remote_agents["P"] = {(0, 0): "P-r0", (0, 1): "P-r1"}
    w.nixl_wrapper = agents = _Agents(gone)
    _load_from(w, "r", closed_port(), tp_size=2)
    _held_after_deadline(w, clock, "r")
    every = gone == {"P-r0", "P-r1"}
    end = time.monotonic() + 10.0
    for _ in range(12):  # far more refusals than the probe needs to call P gone
        clock.now += 1.0
        w.drain_step()
        time.sleep(0.02)
        if every and not w.failure_reporter.is_quarantined("r"):
            break
        assert time.monotonic() < end
    assert w.failure_reporter.is_quarantined("r") is not every
    assert agents.sent and all(msg == b"HB:" for _, msg in agents.sent)


@pytest.mark.parametrize("gone", [{"P-r0", "P-r1"}, {"P-r0"}])
def test_a_load_whose_p_dies_after_its_registration_went_out_fails_before_its_deadline(
    sent: list[str], gone: set[str]
) -> None:
    """A P that dies once it has D's registration sends nothing more, and a push D posted
    no transfer that could fail: only P's side channel can tell. The watch before each
    poll reports the load failed at once (before, it waited for its deadline, or for ever
    without one); its blocks go back only once every writer is proven gone."""
    clock = ManualClock(100.0)  # never advanced: the deadline cannot fire
    w = _worker(clock)
    w._remote_agents["P"] = {(0, 0): "P-r0", (0, 1): "P-r1"}
    w.nixl_wrapper = _Agents(gone)
    _load_from(w, "r", closed_port(), tp_size=2)
    w._do_send_reg_notif("r", {})
    every = gone == {"P-r0", "P-r1"}
    failed: set[str] = set()
    end = time.monotonic() + 10.0
    while "r" not in failed or (every and w.failure_reporter.is_quarantined("r")):
        assert time.monotonic() < end, "the load of a gone P was never failed and settled"
        w._kvfail_watch_peers()
        failed |= w.drain_step().failed_recving
        time.sleep(0.05)
    assert w.failure_reporter.is_quarantined("r") is not every
    assert sent == ["r"]


def test_writers_of_a_stage_d_never_met_are_not_proven_gone(sent: list[str]) -> None:
    """P at PP 2, but D knows only stage 0's agents: their endpoints being closed says
    nothing of stage 1's writers, so the hold stays for its notifications."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    w._remote_agents["P"] = {(0, 0): "P-s0"}
    w.nixl_wrapper = _Agents({"P-s0"})
    _load_from(w, "r", closed_port(), pp_size=2)
    _held_after_deadline(w, clock, "r")
    for _ in range(12):
        clock.now += 1.0
        w.drain_step()
        time.sleep(0.02)
        assert w.failure_reporter.is_quarantined("r")


def test_a_p_whose_name_stops_resolving_keeps_its_hold_and_the_drain_runs(
    sent: list[str], caplog: pytest.LogCaptureFixture, unresolvable_name: str
) -> None:
    """The fence once raised ``gaierror`` (a blocking lookup on an IPv4 socket) at every
    retry; now the lookup runs off the drain, the hold stays (no proof that P's writers
    are gone), and it is said once."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    _load_from(w, "r", 5555, host=unresolvable_name)
    _held_after_deadline(w, clock, "r")
    end = time.monotonic() + 10.0
    with caplog.at_level("WARNING", logger="kvfail.nixl.push"):
        while not any("does not resolve" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < end, "the failed lookup was never said"
            clock.now += 1.0
            assert w.kvfail_fence("r") is False  # raised gaierror before
            time.sleep(0.02)
        for _ in range(5):
            clock.now += 1.0
            assert w.kvfail_fence("r") is False
    said = [r for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(said) == 1
    assert w.failure_reporter.is_quarantined("r")


def test_an_overdue_hold_stays_held_is_counted_and_named_once(
    sent: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Past ``kvfail_max_hold_s`` a live P's hold is not freed (nothing proves its
    WRITE over): counted once, and logged once naming the P."""
    clock = ManualClock(100.0)
    w = _worker(clock)
    w._kvfail_max_hold_s = 0.05
    with _live_port() as port:
        _load_from(w, "r", port)
        w._do_send_reg_notif("r", {})
        _past_deadline(w, clock)
        notice = w.take_quarantine_notice()
        assert notice.held == {("r", 0)}
        assert notice.peers == {"r": f"127.0.0.1:{port}"}  # the hold names its P
        time.sleep(0.1)
        with caplog.at_level("INFO", logger="kvfail.nixl.push"):
            for _ in range(4):
                assert w.kvfail_fence("r") is False
    assert w.failure_reporter.is_quarantined("r")
    assert w.kvfail_holds_overdue == 1
    said = [r.getMessage() for r in caplog.records if "kvfail_max_hold_s" in r.getMessage()]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0]
