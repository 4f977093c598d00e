"""What P answers, through upstream's real reply path: ``KvfailMooncakeWorker`` on CPU.

P is :class:`FakePrefill`: real ZMQ ROUTER sockets on 127.0.0.1 registered on upstream's
own bootstrap server, scripted per request, so each outcome reaches D through the same code
upstream uses for a real P's reply. The D side and what every failure test checks are
:mod:`tests.connectors.mooncake_d_side`'s.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from connectors.mooncake import KvfailMooncakeConnector, KvfailMooncakeWorker  # noqa: E402
from kvfail import FailureReporterMixin, Stage  # noqa: E402
from tests.connectors.fake_mooncake_p import BOGUS, HOLEY, TWO, FakePrefill  # noqa: E402
from tests.connectors.mooncake_d_side import (  # noqa: E402
    DEADLINE_S,
    assert_each_fails_once,
    assert_failed_once,
    assert_succeeded_once,
    build_worker_connector,
    make_pull,
    poll,
    stage_counts,
    start,
    worker_of,
)

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------- loading


def test_loads_through_module_path(mooncake_d: KvfailMooncakeConnector) -> None:
    worker = worker_of(mooncake_d)
    assert isinstance(worker, KvfailMooncakeWorker)
    assert isinstance(worker, FailureReporterMixin)
    assert worker.failure_reporter.default_deadline_s == DEADLINE_S
    # Upstream's own failure queues exist but are never filled by our worker.
    assert worker._invalid_block_ids.empty() and worker._failed_recv_reqs.empty()


# ---------------------------------------------------------------------------- P's replies


def test_success_is_delivered_once(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    pull = make_pull(fake_mooncake_p.url, "ok")
    start(mooncake_d, pull)
    assert_succeeded_once(poll(mooncake_d, {pull.req_id}), pull)


def test_error_reply_fails_the_whole_exchange(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    pulls = [make_pull(fake_mooncake_p.url, "error"), make_pull(fake_mooncake_p.url, "error")]
    _, counted = assert_each_fails_once(mooncake_d, *pulls)
    assert counted[Stage.PEER] == 2


def test_err_reqs_fail_only_the_named_requests(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    bad, good = make_pull(fake_mooncake_p.url, "err"), make_pull(fake_mooncake_p.url, "ok")
    start(mooncake_d, bad, good)
    obs = poll(mooncake_d, {bad.req_id, good.req_id})
    assert_failed_once(obs, bad)
    assert_succeeded_once(obs, good)
    assert worker_of(mooncake_d).failure_reporter.failure_of(bad.req_id) is None  # delivered


def test_peer_finishing_without_naming_a_request(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    before = stage_counts(mooncake_d)
    omitted, good = make_pull(fake_mooncake_p.url, "omit"), make_pull(fake_mooncake_p.url, "ok")
    start(mooncake_d, omitted, good)
    obs = poll(mooncake_d, {omitted.req_id, good.req_id})
    assert_failed_once(obs, omitted)
    assert_succeeded_once(obs, good)
    assert stage_counts(mooncake_d)[Stage.PEER] - before[Stage.PEER] == 1


def test_undecodable_reply_is_a_peer_failure_whose_blocks_stay_held(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """P answered in a form D cannot read, so D cannot know whether P pushed or still
    will. The load fails at once, by request (``recompute`` then runs in fresh blocks),
    and its blocks stay held (C11): P is alive, so nothing proves its push over."""
    before = stage_counts(mooncake_d)
    pull = make_pull(fake_mooncake_p.url, "garbage")
    start(mooncake_d, pull)
    obs = poll(mooncake_d, {pull.req_id})
    assert obs.finished[pull.req_id] == 1 and obs.failed[pull.req_id] == 1
    assert obs.failed_pass[pull.req_id] == obs.finished_pass[pull.req_id]  # C3
    assert pull.req_id in obs.held and pull.req_id not in obs.released
    assert stage_counts(mooncake_d)[Stage.PEER] - before[Stage.PEER] == 1


def test_ids_p_invents_never_reach_the_scheduler(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    pull = make_pull(fake_mooncake_p.url, "unknown")
    start(mooncake_d, pull)
    obs = poll(mooncake_d, {pull.req_id})
    assert_succeeded_once(obs, pull)
    assert set(obs.finished) == {pull.req_id}
    assert not obs.failed


def test_a_pull_that_never_left_d_is_a_transfer_failure_that_frees_its_blocks(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """D's DEALER could not even be built (a bad endpoint, ZMQError): upstream's exception
    path, Stage.TRANSFER. The pull never reached P, so nothing can write and the failure
    is block-level, its blocks free at once."""
    pull = make_pull(fake_mooncake_p.url, "ok", engine=BOGUS)
    obs, counted = assert_each_fails_once(mooncake_d, pull)
    assert counted[Stage.TRANSFER] == 1
    assert not obs.held


def test_missing_p_rank_is_a_handshake_failure(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """Upstream's receive_kv raises (KeyError); 0.32.0 would lose the request there."""
    pull = make_pull(fake_mooncake_p.url, "ok", engine=HOLEY)
    _, counted = assert_each_fails_once(mooncake_d, pull)
    assert counted[Stage.HANDSHAKE] == 1
    assert fake_mooncake_p.exchanges_for(pull.req_id) == []


def test_every_p_worker_settles_before_delivery(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """P-two has two workers; D must wait for both (C11), then fail if either failed."""
    slow_ok = make_pull(fake_mooncake_p.url, "split", engine=TWO)
    slow_err = make_pull(fake_mooncake_p.url, "spliterr", engine=TWO)
    start(mooncake_d, slow_ok, slow_err)
    obs = poll(mooncake_d, {slow_ok.req_id, slow_err.req_id})
    assert_succeeded_once(obs, slow_ok)
    assert_failed_once(obs, slow_err)
    for pull in (slow_ok, slow_err):
        exchanges = fake_mooncake_p.exchanges_for(pull.req_id)
        assert {e.worker for e in exchanges} == {f"{TWO}/0", f"{TWO}/1"}
        last_reply = max(t for e in exchanges for t in e.replied_at)
        assert obs.finished_at[pull.req_id] >= last_reply  # ordering, not a timing


# ---------------------------------------------------------------------------- two KV-cache groups


def test_two_kv_cache_groups_fail_by_request(fake_mooncake_p: FakePrefill) -> None:
    """Block ids are per group, so failures go out as failed_recving only (C5, C6)."""
    conn = build_worker_connector("D-two-groups", num_groups=2)
    try:
        bad = make_pull(fake_mooncake_p.url, "err", local_block_ids=[[1, 2], [1, 2]])
        good = make_pull(fake_mooncake_p.url, "ok", local_block_ids=[[3], [3]])
        start(conn, bad, good)
        obs = poll(conn, {bad.req_id, good.req_id})
        assert obs.finished == Counter({bad.req_id: 1, good.req_id: 1})
        assert obs.failed == Counter({bad.req_id: 1})
        assert obs.failed_pass[bad.req_id] == obs.finished_pass[bad.req_id]  # paired (C6)
        assert not obs.invalid
    finally:
        conn.shutdown()
