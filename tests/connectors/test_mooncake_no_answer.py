"""Loads P never answers for: a bootstrap that fails, hangs or only logs, a silent P the
watchdog fails, and a lost P worker whose engines must be looked up again.

Each must be reported once, at the stage where it was detected, and no pull may start for
a load that already ended (C11). The D side and its checks are
:mod:`tests.connectors.mooncake_d_side`'s; P is :class:`FakePrefill` (or nothing at all).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnectorWorker,
)

from connectors.mooncake import KvfailMooncakeConnector  # noqa: E402
from kvfail import Stage  # noqa: E402
from tests.connectors.fake_mooncake_p import LATE_S, ONE, FakePrefill, SlowBootstrap  # noqa: E402
from tests.connectors.mooncake_d_side import (  # noqa: E402
    BOUND_S,
    DEADLINE_S,
    assert_each_fails_once,
    assert_failed_once,
    closed_port,
    make_pull,
    poll,
    stage_counts,
    start,
    worker_of,
)

pytestmark = pytest.mark.vllm


def test_bootstrap_refused_is_reported(mooncake_d: KvfailMooncakeConnector) -> None:
    pull = make_pull(f"http://127.0.0.1:{closed_port()}", "ok", engine="P-gone")
    _, counted = assert_each_fails_once(mooncake_d, pull)
    # Refused three times 0.1 s apart: the bootstrap path, well before the watchdog.
    assert counted[Stage.BOOTSTRAP] == 1


def test_unknown_engine_id_is_a_bootstrap_failure(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    pull = make_pull(fake_mooncake_p.url, "ok", engine="P-nobody-registered")
    _, counted = assert_each_fails_once(mooncake_d, pull)
    assert counted[Stage.BOOTSTRAP] == 1


def test_a_bootstrap_that_only_logs_its_failure_is_still_reported(
    mooncake_d: KvfailMooncakeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's lookup on some releases (0.29) logs a P engine it could not find and
    returns without failing the pulls or starting one. kvfail must still report the
    load at the bootstrap, once, not leave it to the deadline (or, without one, strand
    it in WAITING_FOR_REMOTE_KVS: the conformance suite's test_peer_killed_before_pull).
    Upstream's lookup is replaced by one that finds nothing and says so only in a log."""

    async def finds_nothing(self: Any, remote_engine_id: str, pull_metas: Any) -> None:
        return None

    monkeypatch.setattr(MooncakeConnectorWorker, "handle_new_engine_id", finds_nothing)
    pull = make_pull(f"http://127.0.0.1:{closed_port()}", "ok", engine="P-logged-only")
    _, counted = assert_each_fails_once(mooncake_d, pull)
    # The bootstrap's failure, not the deadline's.
    assert counted[Stage.BOOTSTRAP] == 1 and counted[Stage.WATCHDOG] == 0


def test_silent_peer_is_failed_by_the_watchdog(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """P receives the request and answers only after LATE_S (> the deadline).

    The watchdog reports it once, after P took the pull in, by request id (recompute must
    start in fresh blocks), and names it in a hold notice: P may still push into its
    blocks. The pull keeps running; P's late reply ends it, which proves the write over,
    and the next pass releases the blocks. Nothing is reported twice (C8).
    """
    worker = worker_of(mooncake_d)
    before = stage_counts(mooncake_d)
    pull = make_pull(fake_mooncake_p.url, "late")
    started = time.monotonic()
    start(mooncake_d, pull, deadline_s=DEADLINE_S)
    obs = poll(mooncake_d, {pull.req_id}, timeout_s=DEADLINE_S + BOUND_S, settle_s=0.0)
    assert obs.finished[pull.req_id] == 1 and obs.failed[pull.req_id] == 1, obs
    assert obs.failed_pass[pull.req_id] == obs.finished_pass[pull.req_id] and not obs.invalid
    assert obs.held == {pull.req_id} and not obs.released
    # P held the pull when the watchdog failed it: the silent peer, not a refused one.
    received = [e.received_at for e in fake_mooncake_p.exchanges_for(pull.req_id)]
    assert received and obs.finished_at[pull.req_id] >= received[0]  # ordering, not a timing
    assert stage_counts(mooncake_d)[Stage.WATCHDOG] - before[Stage.WATCHDOG] == 1
    # Let P's late reply go out, then make sure it changes nothing.
    remaining = started + LATE_S + 0.5 - time.monotonic()
    released = lambda o: pull.req_id in o.released  # noqa: E731 - P's reply ends the pull
    after = poll(
        mooncake_d, set(), timeout_s=max(remaining, 0.1) + 30.0, settle_s=BOUND_S, until=released
    )
    assert not after.finished and not after.invalid and not after.failed
    assert fake_mooncake_p.exchanges_for(pull.req_id)[0].replied_at  # P did answer, too late
    assert after.released == {pull.req_id}  # its reply ended the pull: blocks go back
    assert pull.req_id not in worker._mc_tasks
    assert not worker.failure_reporter.is_tracked(pull.req_id)


def test_watchdog_bounds_a_hung_bootstrap_and_no_pull_follows(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """The bootstrap query hangs past the deadline, then answers.

    The watchdog reports the load (upstream: up to 3 x 30 s); when the answer finally
    arrives, no pull may start for it: its blocks may already belong to another request
    and P would write into them (C11).
    """
    before = stage_counts(mooncake_d)
    slow = SlowBootstrap("P-slow-boot", fake_mooncake_p.worker_addr(f"{ONE}/0"), DEADLINE_S + 1.0)
    try:
        pull = make_pull(slow.url, "ok", engine="P-slow-boot")
        start(mooncake_d, pull, deadline_s=DEADLINE_S)
        obs = poll(mooncake_d, {pull.req_id}, timeout_s=DEADLINE_S + BOUND_S, settle_s=0.0)
        assert_failed_once(obs, pull)
        assert stage_counts(mooncake_d)[Stage.WATCHDOG] - before[Stage.WATCHDOG] == 1
        assert slow.answered.wait(timeout=BOUND_S)
        after = poll(mooncake_d, set(), timeout_s=0.5, settle_s=0.5)
        assert not after.finished and not after.invalid
        assert fake_mooncake_p.exchanges_for(pull.req_id) == []  # no pull after the load ended
    finally:
        slow.close()


def test_a_lost_p_worker_makes_its_engines_be_looked_up_again(
    mooncake_d: KvfailMooncakeConnector,
) -> None:
    """A P restarted under the same engine id listens on new ports; upstream caches P's
    worker addresses per engine id for D's lifetime. Losing a worker must drop exactly
    the engines that used it (found in the e2e tier: D kept dialling a dead P)."""
    worker = mooncake_d.connector_worker
    dead, alive = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    saved_agents, saved_tp = dict(worker._remote_agents), dict(worker._tp_size)
    try:
        worker._remote_agents["P-restarted"] = {0: {0: dead}, 1: {0: alive}}
        worker._remote_agents["P-other"] = {0: {0: alive}}
        worker._tp_size["P-restarted"] = 2
        worker._mc_forget_engines_at(dead)
        assert "P-restarted" not in worker._remote_agents
        assert "P-restarted" not in worker._tp_size
        assert worker._remote_agents["P-other"] == {0: {0: alive}}
    finally:
        worker._remote_agents.clear()
        worker._remote_agents.update(saved_agents)
        worker._tp_size.clear()
        worker._tp_size.update(saved_tp)
