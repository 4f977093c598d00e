"""A real NIXL P/D pair (UCX over TCP loopback, DRAM) through the harness, both D connectors.

Why: the conformance suite's NIXL scenarios are only worth something if the bytes really
travel P -> D through vLLM's real NIXL pull connector, and if each fault reaches D's real
scheduler the way it does in a real deployment. One P process (upstream's
``NixlConnector``) serves three D engines in this process: upstream ``NixlConnector``
under ``fail`` and ``recompute``, and ``KvfailNixlConnector`` with a 3 s deadline. The
freeze test thaws P again, so only the kill test (near the end) and the restart (slow)
need a new P.

This process creates nixl agents, so it would segfault at exit: the pair installs
``kvfail.peers.nixl_exit_guard.install_exit_guard`` (``os._exit`` with pytest's exit status).

No assertion reads a detection time: each fault is checked by its cause (the failure
upstream logs, the stage kvfail counts). The times are printed (``-s``);
``bench/nixl_detection.py`` measures them against upstream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.transports import require_transport

require_transport("nixl")

from kvfail.harness import oracles  # noqa: E402
from kvfail.peers.nixl import (  # noqa: E402
    BAD_METADATA,
    HANDSHAKE_TIMEOUT_S,
    NixlPair,
    unknown_engine,
    wrong_port,
)
from kvfail.peers.nixl_exit_guard import install_exit_guard  # noqa: E402
from kvfail.peers.stepping import all_blocks_free  # noqa: E402

pytestmark = pytest.mark.vllm

#: kvfail's deadline in the freeze test (short, so the test is fast).
DEADLINE_S = 3.0
#: How long upstream is watched while P is frozen (the suite's default silent wait).
SILENT_CAP_S = 6.0
UP_FAIL, UP_RECOMPUTE, KVFAIL = "up-fail", "up-recompute", "kvfail-fail"
DETECTION: dict[str, float | None] = {}


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[NixlPair]:
    install_exit_guard(request.config)
    p = NixlPair(build_default_consumer=False)
    try:
        p.consumer("fail", name=UP_FAIL)
        p.consumer("recompute", name=UP_RECOMPUTE)
        p.consumer(
            "fail",
            name=KVFAIL,
            connector="KvfailNixlConnector",
            connector_module="connectors.nixl",
            extra_config={"kvfail_deadline_s": DEADLINE_S},
        )
        # One real pull first: this D's deadline (3 s) can be shorter than a cold first
        # pull on a loaded machine, which includes the handshake. Tests that need a cold D
        # build one.
        p.warm(KVFAIL, within_s=60.0)
        yield p
    finally:
        p.close()
        print("\nNIXL detection times (s):", DETECTION)


def _finish(pair: NixlPair, consumer: str, req_id: str, timeout_s: float = 20.0) -> None:
    run = pair.run([req_id], consumer=consumer, timeout_s=timeout_s)
    tail = pair.p.process.output_tail() if pair.p else ""
    assert run.ok, (run, pair.records[req_id], tail)


def _violations(pair: NixlPair, consumer: str, req_id: str, failed: bool) -> list[str]:
    return oracles.check_all(pair.decoders[consumer], [req_id], failed=failed)


def _failure_log(
    pair: NixlPair, consumer: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str | None, str]]:
    """What ``consumer``'s upstream worker logs as failures from now on: (type, request id,
    exception class). It names the cause of a failure, where a detection time would not."""
    worker = pair.decoders[consumer].workers[0].connector.connector_worker
    log = worker._log_failure
    seen: list[tuple[str, str | None, str]] = []

    def spy(failure_type: str, req_id: str | None, *args: Any, **kwargs: Any) -> Any:
        error = kwargs.get("error", args[1] if len(args) > 1 else None)
        seen.append((failure_type, req_id, type(error).__name__))
        return log(failure_type, req_id, *args, **kwargs)

    monkeypatch.setattr(worker, "_log_failure", spy)
    return seen


def _status(pair: NixlPair, consumer: str, req_id: str) -> str:
    status = pair.decoders[consumer].status(req_id)
    return "None" if status is None else status.name


@pytest.mark.parametrize("consumer", [UP_FAIL, KVFAIL])
def test_happy_path_bytes_arrive_exactly(pair: NixlPair, consumer: str) -> None:
    rid = f"happy-{consumer}"
    rec = pair.prefill_and_add(rid, prompt_len=100, consumer=consumer)
    _finish(pair, consumer, rid)
    assert pair.verify(rid), rec.mismatches
    assert not rec.failed and _status(pair, consumer, rid) == "FINISHED_LENGTH_CAPPED"
    assert rec.reported_s is not None, rec  # named in D's finished_recving
    DETECTION[f"happy {consumer}"] = rec.reported_s
    assert _violations(pair, consumer, rid, failed=False) == []
    # P frees its blocks once D's completion notification arrives (bounded wait).
    assert pair.p is not None
    end = time.monotonic() + 10.0
    while rid not in pair.p.stats()["finished_sending"] and time.monotonic() < end:
        time.sleep(0.05)
    assert rid in pair.p.stats()["finished_sending"]


def test_wrong_side_channel_port_fails_at_the_handshake_timeout(
    pair: NixlPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zmq retries a refused connect silently: the handshake fails at its 5 s timeout.

    A cold D: one that already knows P's engine id never handshakes again, so it would
    ignore the wrong port and pull from the agent it holds (observed)."""
    cold = "up-cold"
    pair.consumer("fail", name=cold)
    failures = _failure_log(pair, cold, monkeypatch)
    params = wrong_port(pair.prefill("refused", 100))
    rec = pair.add("refused", params, consumer=cold)
    _finish(pair, cold, "refused", timeout_s=HANDSHAKE_TIMEOUT_S + 15)
    assert rec.failed and _status(pair, cold, "refused") == "FINISHED_ERROR"
    # zmq's receive timeout (RCVTIMEO) ended the handshake: no faster error came first.
    assert [f for f in failures if f[1] == "refused"] == [("handshake_failed", "refused", "Again")]
    DETECTION["refused handshake"] = rec.reported_s
    assert _violations(pair, cold, "refused", failed=True) == []


def test_unknown_engine_id_is_reported(pair: NixlPair) -> None:
    """P answers the handshake for its own engine, not the one D asked for."""
    params = unknown_engine(pair.prefill("unknown", 100))
    rec = pair.add("unknown", params, consumer=UP_FAIL)
    _finish(pair, UP_FAIL, "unknown", timeout_s=HANDSHAKE_TIMEOUT_S + 15)
    assert rec.failed and _status(pair, UP_FAIL, "unknown") == "FINISHED_ERROR"
    DETECTION["unknown engine"] = rec.reported_s
    assert _violations(pair, UP_FAIL, "unknown", failed=True) == []


def test_frozen_peer_kvfail_reports_at_deadline_upstream_waits(pair: NixlPair) -> None:
    """SIGSTOP P after both D's handshaked: the READs sit in PROC. kvfail's deadline fails
    its load; upstream is still waiting at the cap. Thawed, upstream's READ completes."""
    for consumer in (UP_FAIL, KVFAIL):  # warm both: the handshake is done before the freeze
        pair.prefill_and_add(f"warm-{consumer}", 100, consumer=consumer)
        _finish(pair, consumer, f"warm-{consumer}")
    before = _kvfail_stats(pair, KVFAIL)
    recs = {c: pair.prefill_and_add(f"frozen-{c}", 100, consumer=c) for c in (UP_FAIL, KVFAIL)}
    pair.fault_after_handshake(f"frozen-{UP_FAIL}", "freeze", consumer=UP_FAIL)
    recs[KVFAIL].injected_at = recs[UP_FAIL].injected_at
    engines = [pair.decoders[UP_FAIL], pair.decoders[KVFAIL]]
    end = time.monotonic() + SILENT_CAP_S
    while time.monotonic() < end:  # both D's stepped together, as concurrent engines
        for engine in engines:
            engine.step()
            pair.observe(engine)
        time.sleep(0.005)
    kv = recs[KVFAIL]
    assert kv.failed and _status(pair, KVFAIL, f"frozen-{KVFAIL}") == "FINISHED_ERROR", kv
    after = _kvfail_stats(pair, KVFAIL)
    # kvfail's deadline failed it (the watchdog), not an error from the stopped peer.
    assert after["stage.watchdog"] - before["stage.watchdog"] == 1, (before, after)
    assert after["loads_failed"] - before["loads_failed"] == 1, (before, after)
    DETECTION["frozen, kvfail"] = kv.reported_s
    up = recs[UP_FAIL]
    assert up.reported_s is None, up  # upstream has no deadline for a READ in PROC
    assert _status(pair, UP_FAIL, f"frozen-{UP_FAIL}") == "WAITING_FOR_REMOTE_KVS"
    DETECTION["frozen, upstream"] = None
    # What a stuck load looks like from D's workers (the suite's liveness evidence).
    up_state, p_state = pair.stuck_state(pair.decoders[UP_FAIL], [f"frozen-{UP_FAIL}"])[:2]
    assert "handles ['PROC']" in up_state and "handshake pending False" in up_state, up_state
    # ... and from P's side: stopped (kernel state T), so it is not asked for counters.
    assert p_state.startswith("P ") and " T, ranks [" in p_state, p_state
    # kvfail reported its load, but never released the READ still in flight: a released
    # UCX GET can still land its reply, so its handle (and blocks) are held until it ends.
    kv_state = pair.stuck_state(pair.decoders[KVFAIL], [f"frozen-{KVFAIL}"])[0]
    assert "handles ['PROC']" in kv_state, kv_state
    pair.thaw_p()
    _finish(pair, UP_FAIL, f"frozen-{UP_FAIL}")
    assert not up.failed and pair.verify(f"frozen-{UP_FAIL}"), up
    # kvfail held its READ's blocks while the stopped P could still serve it; thawed, the
    # READ ends, its handle is released and the blocks come back. Only then would a
    # missing block be a leak.
    # The held blocks keep the engine stepping (has_pending_push_work).
    engine = pair.decoders[KVFAIL]
    pair.step_until(engine, lambda: all_blocks_free(engine), 30.0)
    assert _violations(pair, KVFAIL, f"frozen-{KVFAIL}", failed=True) == []


def test_notification_faults_touch_only_armed_done_notifications() -> None:
    """The D-side fault point at the transport boundary: an armed READ is posted without
    its notification, an armed ``send_notif`` raises, and everything else (other ids,
    heartbeats, other calls) reaches the real agent unchanged."""
    from kvfail.peers.nixl_notify_faults import NotificationFaults, NotifyFaultAgent

    calls: list[tuple[str, tuple, dict]] = []

    class Agent:  # records what reaches "the real agent"
        name = "real"

        def make_prepped_xfer(self, *args: object, **kwargs: object) -> str:
            calls.append(("xfer", args, kwargs))
            return "handle"

        def send_notif(self, agent: str, notif_msg: bytes) -> None:
            calls.append(("notif", (agent, notif_msg), {}))

    faults = NotificationFaults()
    faults.arm("req-a")
    agent = NotifyFaultAgent(Agent(), faults)
    assert agent.name == "real"
    agent.make_prepped_xfer("READ", 1, [0], 2, [0], notif_msg=b"req-a:1")
    agent.make_prepped_xfer("READ", 1, [0], 2, [0], b"req-a:1")
    agent.make_prepped_xfer("READ", 1, [0], 2, [0], notif_msg=b"req-b:1")
    agent.send_notif("P", notif_msg=b"HB:req-a,req-b")
    with pytest.raises(Exception, match="req-a:2"):
        agent.send_notif("P", notif_msg=b"req-a:2")
    assert [c[2].get("notif_msg", c[1][5] if len(c[1]) > 5 else None) for c in calls[:3]] == [
        b"",
        b"",
        b"req-b:1",
    ]
    assert calls[3] == ("notif", ("P", b"HB:req-a,req-b"), {})
    assert len(calls) == 4
    assert faults.dropped == ["req-a", "req-a"] and faults.raised == ["req-a"]
    assert faults.fired("req-a") and not faults.fired("req-b")


def _kvfail_stats(pair: NixlPair, consumer: str) -> dict[str, int]:
    worker = pair.decoders[consumer].workers[0].connector.connector_worker
    return dict(worker.failure_stats().as_dict())


@pytest.mark.parametrize("kind", BAD_METADATA)
def test_bad_handshake_metadata_fails_the_load_at_the_handshake(pair: NixlPair, kind: str) -> None:
    """P's real side channel answers with a garbled agent (NIXL's ``loadRemoteMD`` raises
    ``nixlMismatchError``) or a layout unlike D's (upstream's layout check asserts): a cold
    D fails the load in its handshake thread; kvfail reports it once, stage ``handshake``,
    never raised into the engine. Upstream D, cold too, fails it the same way."""
    cold = {c: f"{c}-cold-{kind}" for c in ("up", "kvfail")}
    pair.consumer("fail", name=cold["up"])
    pair.consumer(
        "fail",
        name=cold["kvfail"],
        connector="KvfailNixlConnector",
        connector_module="connectors.nixl",
        extra_config={"kvfail_deadline_s": 30.0},
    )
    rids = {c: f"bad-{kind}-{c}" for c in cold}
    params = {c: pair.prefill(rid, 100) for c, rid in rids.items()}
    pair.serve_bad_metadata(kind)
    try:
        for c, rid in rids.items():
            pair.add(rid, params[c], consumer=cold[c])
        for c, rid in rids.items():
            _finish(pair, cold[c], rid, timeout_s=HANDSHAKE_TIMEOUT_S + 15)
    finally:
        served = pair.serve_bad_metadata(None)
        pair.expire_leases(rids.values())
    assert served >= 2, f"P served {served} bad answers for two cold D handshakes"
    for c, rid in rids.items():
        rec = pair.records[rid]
        assert rec.failed and _status(pair, cold[c], rid) == "FINISHED_ERROR", rec
        assert rec.verified is None, rec  # never ran: nothing was used
        assert _violations(pair, cold[c], rid, failed=True) == []
        DETECTION[f"bad metadata {kind}, {c}"] = rec.reported_s
    stats = _kvfail_stats(pair, cold["kvfail"])
    assert stats["loads_failed"] == 1 and stats["stage.handshake"] == 1, stats


@pytest.mark.parametrize("consumer", [UP_FAIL, KVFAIL])
def test_lost_notification_keeps_the_load_and_p_holds_until_its_lease(
    pair: NixlPair, consumer: str
) -> None:
    """D's done-notification never reaches P (the real READ is posted without it): D's
    load succeeds with P's exact bytes and is not reported failed; P, never told, keeps
    its blocks (a control pull in the same D is notified) until its send lease ends,
    then frees them."""
    faults = pair.break_notifications(consumer)
    lost, control = f"notify-lost-{consumer}", f"notify-control-{consumer}"
    before = _kvfail_stats(pair, KVFAIL)
    faults.arm(lost)
    for rid in (lost, control):
        pair.prefill_and_add(rid, 100, consumer=consumer)
    # Both run to their end before either is judged: the engine-wide oracles would flag
    # the other one while it still runs (it may load a few steps later).
    for rid in (lost, control):
        _finish(pair, consumer, rid)
    for rid in (lost, control):
        rec = pair.records[rid]
        assert not rec.failed and pair.verify(rid), rec
        assert _status(pair, consumer, rid) == "FINISHED_LENGTH_CAPPED"
        assert _violations(pair, consumer, rid, failed=False) == []
    assert faults.dropped == [lost] and faults.raised == []
    assert pair.p is not None
    end = time.monotonic() + 10.0
    while control not in pair.p.stats()["notified"] and time.monotonic() < end:
        time.sleep(0.05)
    stats = pair.p.stats()
    assert control in stats["notified"] and control in stats["finished_sending"], stats
    assert lost not in stats["notified"] and lost not in stats["finished_sending"], stats
    leases = pair.expire_leases([lost])
    assert leases["pending"] == [lost] and leases["notified"] == [], leases
    end = time.monotonic() + 10.0
    while lost not in pair.p.stats()["finished_sending"] and time.monotonic() < end:
        time.sleep(0.05)
    assert lost in pair.p.stats()["finished_sending"]  # freed by the lease, not notified
    after = _kvfail_stats(pair, KVFAIL)
    assert after["loads_failed"] == before["loads_failed"], (before, after)


def test_killed_after_handshake_fail_errors_recompute_completes(
    pair: NixlPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL P after the handshake, before the READ: posting the READ raises
    ``nixlRemoteDisconnectError``. ``fail`` ends FINISHED_ERROR; ``recompute`` recomputes
    the whole prompt locally and completes. Kills P (the restart test replaces it)."""
    rids = {c: f"killed-{c}" for c in (UP_FAIL, UP_RECOMPUTE)}
    failures = {c: _failure_log(pair, c, monkeypatch) for c in rids}
    for consumer, rid in rids.items():
        pair.prefill_and_add(rid, 100, consumer=consumer)
    for consumer in rids:
        # A D that already holds P's agent posts the READ in its next step, which could
        # then finish before the kill; only a D still to handshake is stepped (it schedules
        # the load and handshakes in the background), then waited on without stepping.
        engine = pair.decoders[consumer]
        if pair.handshaked(engine):
            continue
        engine.step()
        pair.observe(engine)
        end = time.monotonic() + 15.0
        while not pair.handshaked(engine) and time.monotonic() < end:
            time.sleep(0.005)
        assert pair.handshaked(engine), f"{consumer} never handshaked with P"
    pair.kill_p()
    now = time.monotonic()
    for consumer, rid in rids.items():
        pair.records[rid].injected_at = now
        pair.records[rid].steps_at_injection = pair.decoders[consumer].record.steps
    for consumer, rid in rids.items():
        _finish(pair, consumer, rid)
    fail, rec = pair.records[rids[UP_FAIL]], pair.records[rids[UP_RECOMPUTE]]
    assert fail.failed and _status(pair, UP_FAIL, rids[UP_FAIL]) == "FINISHED_ERROR", fail
    assert fail.reported_s is not None, fail
    for consumer, rid in rids.items():  # each D failed on posting its READ, as documented
        assert {f[2] for f in failures[consumer] if f[1] == rid} == {"nixlRemoteDisconnectError"}
    DETECTION["killed after handshake, fail"] = fail.reported_s
    assert _violations(pair, UP_FAIL, rids[UP_FAIL], failed=True) == []
    assert rec.failed, rec  # reported as a failure, then recomputed
    assert _status(pair, UP_RECOMPUTE, rids[UP_RECOMPUTE]) == "FINISHED_LENGTH_CAPPED"
    assert rec.verified is False and rec.mismatches == {"rank0": []}, rec  # computed locally
    assert _violations(pair, UP_RECOMPUTE, rids[UP_RECOMPUTE], failed=False) == []


@pytest.mark.slow
def test_restarted_peer_serves_again(pair: NixlPair) -> None:
    """A fresh P (new process, new port) after the kill: a cold pull works again."""
    ready = pair.restart_p()
    assert ready is not None and pair.p_usable
    rec = pair.prefill_and_add("after-restart", 100, consumer=UP_FAIL)
    _finish(pair, UP_FAIL, "after-restart")
    assert pair.verify("after-restart"), rec.mismatches
    assert _violations(pair, UP_FAIL, "after-restart", failed=False) == []
