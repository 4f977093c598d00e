"""``KvfailMooncakeConnector`` on CPU: upstream's real worker, real TransferEngine (tcp).

The D-side WORKER connector is built once per module the way vLLM builds it (the factory,
``kv_connector_module_path="connectors.mooncake"``), in a real gloo world of one, with real
KV tensors registered with Mooncake. P is :class:`FakePrefill`: real ZMQ ROUTER sockets
on 127.0.0.1 registered on upstream's own bootstrap server, scripted per request, so each
failure reaches D through the same code upstream uses for a real P's reply. The last
tests run the real ``Scheduler`` (``kvfail.harness.Engine``) for the scheduler half.

What every failure test checks: the request comes out of ``get_transfer_results()`` in
``finished_recving`` exactly once, its blocks come out of
``get_block_ids_with_load_errors()`` exactly once and no later than that pass, and the
failure is counted under the right stage.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # get_ip() must answer loopback
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
pytest.importorskip(
    "mooncake.engine",
    reason="mooncake-transfer-engine(-non-cuda) is not importable (needs libibverbs1)",
)

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorMetadata,
    MooncakeConnectorWorker,
    PullReqMeta,
)
from vllm.v1.request import FinishReason
from vllm.v1.worker.utils import allocate_kv_cache

from connectors.mooncake import (
    KvfailMooncakeConnector,
    KvfailMooncakeStats,
    KvfailMooncakeWorker,
)
from connectors.mooncake.params import UNUSABLE_ENGINE
from kvfail import FailureReporterMixin, Stage
from kvfail.harness.config import EngineSpec, build_config
from kvfail.harness.engine import Engine
from kvfail.harness.workers import ensure_world_of_one
from kvfail.vllm_quarantine import KvfailWorkerMeta
from tests.connectors.fake_mooncake_p import (
    BOGUS,
    HOLEY,
    LATE_S,
    ONE,
    TWO,
    FakePrefill,
    SlowBootstrap,
)

pytestmark = pytest.mark.vllm

DEADLINE_S = 1.5
#: Generous bound for anything that should take well under a second on a busy machine.
BOUND_S = 15.0
EXTRA = {"mooncake_protocol": "tcp", "kvfail_deadline_s": DEADLINE_S}
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def fake_p() -> Iterator[FakePrefill]:
    p = FakePrefill()
    try:
        yield p
    finally:
        p.close()


def build_worker_connector(engine_id: str, num_groups: int = 1) -> KvfailMooncakeConnector:
    """A WORKER-role connector as vLLM builds it, with real KV tensors registered."""
    built = build_config(
        EngineSpec(
            role="consumer",
            connector="KvfailMooncakeConnector",
            connector_module="connectors.mooncake",
            engine_id=engine_id,
            num_blocks=NUM_BLOCKS,
            num_kv_cache_groups=num_groups,
            extra_config=EXTRA,
        )
    )
    vc, kcc = built.vllm_config, built.kv_cache_config
    ensure_world_of_one(vc)
    with set_current_vllm_config(vc):
        conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
        try:
            layout = vc.cache_config.get_resolved_kv_cache_layout()
            caches = allocate_kv_cache(
                kcc, torch.device("cpu"), layout, kernel_block_sizes=[32] * num_groups
            )
            conn.register_kv_caches(caches)
        except BaseException:
            conn.shutdown()
            raise
    assert isinstance(conn, KvfailMooncakeConnector)
    return conn


@pytest.fixture(scope="module")
def connector() -> Iterator[KvfailMooncakeConnector]:
    """The D-side worker connector, shared: every test uses its own ids and blocks."""
    conn = build_worker_connector("D-unit")
    try:
        yield conn
    finally:
        conn.shutdown()


_ids = itertools.count()
_blocks = itertools.count(1)  # block 0 is vLLM's null block


@dataclass
class Pull:
    req_id: str
    blocks: list[int]
    meta: PullReqMeta
    engine_key: str


def make_pull(
    url: str,
    mode: str = "ok",
    *,
    engine: str = ONE,
    n_blocks: int = 2,
    engine_key: str | None = None,
    **overrides: Any,
) -> Pull:
    """A pull of fresh blocks; ``mode`` scripts the fake P (see fake_mooncake_p)."""
    n = next(_ids)
    blocks = [next(_blocks) for _ in range(n_blocks)]
    assert all(b < NUM_BLOCKS for b in blocks), "test suite ran out of distinct block ids"
    fields: dict[str, Any] = {
        "d_req_id": f"{mode}-req-{n}",
        "transfer_id": f"{mode}-xfer-{n}",
        # A notify-only pull carries [] (upstream's request_finished), not [[]].
        "local_block_ids": [blocks] if blocks else [],
        "remote_engine_id": engine,
        "remote_bootstrap_addr": url,
    }
    fields.update(overrides)
    meta = PullReqMeta(**fields)
    return Pull(meta.d_req_id, blocks, meta, engine if engine_key is None else engine_key)


def start(conn: KvfailMooncakeConnector, *pulls: Pull) -> None:
    """What the model runner does with one step's metadata."""
    meta = MooncakeConnectorMetadata()
    for pull in pulls:
        meta.reqs_to_recv[pull.engine_key][pull.req_id] = pull.meta
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.clear_connector_metadata()


@dataclass
class Observed:
    """Everything the worker reported while we polled, pass by pass."""

    finished: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    invalid: Counter[int] = field(default_factory=Counter)
    finished_at: dict[str, float] = field(default_factory=dict)
    #: req_id -> the pass index it was finished in; block -> the pass it was reported in.
    finished_pass: dict[str, int] = field(default_factory=dict)
    invalid_pass: dict[int, int] = field(default_factory=dict)
    failed_pass: dict[str, int] = field(default_factory=dict)
    #: Quarantine notices sent to the scheduler half (request ids held, then released).
    held: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)


def poll(
    conn: KvfailMooncakeConnector,
    want: set[str],
    *,
    timeout_s: float = BOUND_S,
    settle_s: float = 0.2,
    until: Callable[[Observed], bool] | None = None,
) -> Observed:
    """Run worker passes until every id in ``want`` finished (and ``until`` holds, if
    given), then ``settle_s`` more; at most ``timeout_s`` in all."""
    obs = Observed()
    deadline = time.monotonic() + timeout_s
    done_at: float | None = None
    for index in itertools.count():
        now = time.monotonic()
        if now > deadline or (done_at is not None and now - done_at > settle_s):
            break
        results = conn.get_transfer_results(set())
        invalid = conn.get_block_ids_with_load_errors()
        meta = conn.build_connector_worker_meta()  # after the drain, as the runner does
        if isinstance(meta, KvfailWorkerMeta):
            obs.held.update(r for r, _ in meta.notice.held)
            obs.released.update(r for r, _ in meta.notice.released)
        for req in results.finished_recving:
            obs.finished[req] += 1
            obs.finished_at.setdefault(req, time.monotonic())
            obs.finished_pass.setdefault(req, index)
        for req in results.failed_recving:
            obs.failed[req] += 1
            obs.failed_pass.setdefault(req, index)
        for block in invalid:
            obs.invalid[block] += 1
            obs.invalid_pass.setdefault(block, index)
        if done_at is None and want <= obs.finished.keys() and (until is None or until(obs)):
            done_at = time.monotonic()
        time.sleep(0.01)
    return obs


def worker_of(conn: KvfailMooncakeConnector) -> KvfailMooncakeWorker:
    assert conn.connector_worker is not None
    return conn.connector_worker


def assert_failed_once(obs: Observed, pull: Pull) -> None:
    assert obs.finished[pull.req_id] == 1, f"{pull.req_id} finished {obs.finished[pull.req_id]}x"
    for block in pull.blocks:
        assert obs.invalid[block] == 1, f"block {block} of {pull.req_id} reported {obs.invalid}"
        assert obs.invalid_pass[block] <= obs.finished_pass[pull.req_id]  # C3
    assert not obs.failed  # one KV-cache group: block-level channel only (C5)


def assert_succeeded_once(obs: Observed, pull: Pull) -> None:
    assert obs.finished[pull.req_id] == 1
    assert not any(obs.invalid[b] for b in pull.blocks)


def stage_counts(conn: KvfailMooncakeConnector) -> Counter[Stage]:
    return Counter(worker_of(conn).failure_stats().failed_by_stage)


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------- loading


def test_loads_through_module_path(connector: KvfailMooncakeConnector) -> None:
    worker = worker_of(connector)
    assert isinstance(worker, KvfailMooncakeWorker)
    assert isinstance(worker, FailureReporterMixin)
    assert worker.failure_reporter.default_deadline_s == DEADLINE_S
    # Upstream's own failure queues exist but are never filled by our worker.
    assert worker._invalid_block_ids.empty() and worker._failed_recv_reqs.empty()


# ---------------------------------------------------------------------------- P's replies


def test_success_is_delivered_once(connector: KvfailMooncakeConnector, fake_p: FakePrefill) -> None:
    pull = make_pull(fake_p.url, "ok")
    start(connector, pull)
    assert_succeeded_once(poll(connector, {pull.req_id}), pull)


def test_error_reply_fails_the_whole_exchange(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    before = stage_counts(connector)
    pulls = [make_pull(fake_p.url, "error"), make_pull(fake_p.url, "error")]
    start(connector, *pulls)
    obs = poll(connector, {p.req_id for p in pulls})
    for pull in pulls:
        assert_failed_once(obs, pull)
    assert stage_counts(connector)[Stage.PEER] - before[Stage.PEER] == 2


def test_err_reqs_fail_only_the_named_requests(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    bad, good = make_pull(fake_p.url, "err"), make_pull(fake_p.url, "ok")
    start(connector, bad, good)
    obs = poll(connector, {bad.req_id, good.req_id})
    assert_failed_once(obs, bad)
    assert_succeeded_once(obs, good)
    assert worker_of(connector).failure_reporter.failure_of(bad.req_id) is None  # delivered


def test_peer_finishing_without_naming_a_request(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    before = stage_counts(connector)
    omitted, good = make_pull(fake_p.url, "omit"), make_pull(fake_p.url, "ok")
    start(connector, omitted, good)
    obs = poll(connector, {omitted.req_id, good.req_id})
    assert_failed_once(obs, omitted)
    assert_succeeded_once(obs, good)
    assert stage_counts(connector)[Stage.PEER] - before[Stage.PEER] == 1


def test_undecodable_reply_is_a_peer_failure_whose_blocks_stay_held(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """P answered in a form D cannot read, so D cannot know whether P pushed or still
    will. The load fails at once, by request (``recompute`` then runs in fresh blocks),
    and its blocks stay held (C11): P is alive, so nothing proves its push over."""
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "garbage")
    start(connector, pull)
    obs = poll(connector, {pull.req_id})
    assert obs.finished[pull.req_id] == 1 and obs.failed[pull.req_id] == 1
    assert obs.failed_pass[pull.req_id] == obs.finished_pass[pull.req_id]  # C3
    assert pull.req_id in obs.held and pull.req_id not in obs.released
    assert stage_counts(connector)[Stage.PEER] - before[Stage.PEER] == 1


def test_a_pull_that_never_left_d_frees_its_blocks(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """The DEALER could not even be built (a bad endpoint): the pull never reached P,
    so nothing can write and the failure is block-level, its blocks free at once."""
    pull = make_pull(fake_p.url, "ok", engine=BOGUS)
    start(connector, pull)
    obs = poll(connector, {pull.req_id})
    assert_failed_once(obs, pull)
    assert not obs.held


def test_ids_p_invents_never_reach_the_scheduler(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    pull = make_pull(fake_p.url, "unknown")
    start(connector, pull)
    obs = poll(connector, {pull.req_id})
    assert_succeeded_once(obs, pull)
    assert set(obs.finished) == {pull.req_id}
    assert not obs.failed


def test_side_channel_error_is_a_transfer_failure(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """D's DEALER cannot connect (ZMQError): upstream's exception path, Stage.TRANSFER."""
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "ok", engine=BOGUS)
    start(connector, pull)
    assert_failed_once(poll(connector, {pull.req_id}), pull)
    assert stage_counts(connector)[Stage.TRANSFER] - before[Stage.TRANSFER] == 1


def test_missing_p_rank_is_a_handshake_failure(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """Upstream's receive_kv raises (KeyError); 0.32.0 would lose the request there."""
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "ok", engine=HOLEY)
    start(connector, pull)
    assert_failed_once(poll(connector, {pull.req_id}), pull)
    assert stage_counts(connector)[Stage.HANDSHAKE] - before[Stage.HANDSHAKE] == 1
    assert fake_p.exchanges_for(pull.req_id) == []


def test_every_p_worker_settles_before_delivery(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """P-two has two workers; D must wait for both (C11), then fail if either failed."""
    slow_ok = make_pull(fake_p.url, "split", engine=TWO)
    slow_err = make_pull(fake_p.url, "spliterr", engine=TWO)
    start(connector, slow_ok, slow_err)
    obs = poll(connector, {slow_ok.req_id, slow_err.req_id})
    assert_succeeded_once(obs, slow_ok)
    assert_failed_once(obs, slow_err)
    for pull in (slow_ok, slow_err):
        exchanges = fake_p.exchanges_for(pull.req_id)
        assert {e.worker for e in exchanges} == {f"{TWO}/0", f"{TWO}/1"}
        last_reply = max(t for e in exchanges for t in e.replied_at)
        assert obs.finished_at[pull.req_id] >= last_reply  # ordering, not a timing


# ---------------------------------------------------------------------------- no P at all


def test_bootstrap_refused_is_reported(connector: KvfailMooncakeConnector) -> None:
    before = stage_counts(connector)
    pull = make_pull(f"http://127.0.0.1:{closed_port()}", "ok", engine="P-gone")
    start(connector, pull)
    obs = poll(connector, {pull.req_id}, timeout_s=DEADLINE_S + 5.0)
    assert_failed_once(obs, pull)
    # Refused three times 0.1 s apart: the bootstrap path, well before the watchdog.
    assert stage_counts(connector)[Stage.BOOTSTRAP] - before[Stage.BOOTSTRAP] == 1


def test_unknown_engine_id_is_a_bootstrap_failure(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "ok", engine="P-nobody-registered")
    start(connector, pull)
    assert_failed_once(poll(connector, {pull.req_id}), pull)
    assert stage_counts(connector)[Stage.BOOTSTRAP] - before[Stage.BOOTSTRAP] == 1


def test_a_bootstrap_that_only_logs_its_failure_is_still_reported(
    connector: KvfailMooncakeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's lookup on some releases (0.29) logs a P engine it could not find and
    returns without failing the pulls or starting one. kvfail must still report the
    load at the bootstrap, once, not leave it to the deadline (or, without one, strand
    it in WAITING_FOR_REMOTE_KVS: the conformance suite's test_peer_killed_before_pull).
    Upstream's lookup is replaced by one that finds nothing and says so only in a log."""

    async def finds_nothing(self: Any, remote_engine_id: str, pull_metas: Any) -> None:
        return None

    monkeypatch.setattr(MooncakeConnectorWorker, "handle_new_engine_id", finds_nothing)
    before = stage_counts(connector)
    pull = make_pull(f"http://127.0.0.1:{closed_port()}", "ok", engine="P-logged-only")
    start(connector, pull)
    assert_failed_once(poll(connector, {pull.req_id}, timeout_s=DEADLINE_S + 5.0), pull)
    counts = stage_counts(connector)  # the bootstrap's failure, not the deadline's
    assert counts[Stage.BOOTSTRAP] - before[Stage.BOOTSTRAP] == 1
    assert counts[Stage.WATCHDOG] == before[Stage.WATCHDOG]


def test_silent_peer_is_failed_by_the_watchdog(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """P receives the request and answers only after LATE_S (> the deadline).

    The watchdog reports it once, after P took the pull in, by request id (recompute must
    start in fresh blocks), and names it in a hold notice: P may still push into its
    blocks. The pull keeps running; P's late reply ends it, which proves the write over,
    and the next pass releases the blocks. Nothing is reported twice (C8).
    """
    worker = worker_of(connector)
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "late")
    started = time.monotonic()
    start(connector, pull)
    obs = poll(connector, {pull.req_id}, timeout_s=DEADLINE_S + BOUND_S, settle_s=0.0)
    assert obs.finished[pull.req_id] == 1 and obs.failed[pull.req_id] == 1, obs
    assert obs.failed_pass[pull.req_id] == obs.finished_pass[pull.req_id] and not obs.invalid
    assert obs.held == {pull.req_id} and not obs.released
    # P held the pull when the watchdog failed it: the silent peer, not a refused one.
    received = [e.received_at for e in fake_p.exchanges_for(pull.req_id)]
    assert received and obs.finished_at[pull.req_id] >= received[0]  # ordering, not a timing
    assert stage_counts(connector)[Stage.WATCHDOG] - before[Stage.WATCHDOG] == 1
    # Let P's late reply go out, then make sure it changes nothing.
    remaining = started + LATE_S + 0.5 - time.monotonic()
    released = lambda o: pull.req_id in o.released  # noqa: E731 - P's reply ends the pull
    after = poll(
        connector, set(), timeout_s=max(remaining, 0.1) + 30.0, settle_s=BOUND_S, until=released
    )
    assert not after.finished and not after.invalid and not after.failed
    assert fake_p.exchanges_for(pull.req_id)[0].replied_at  # P did answer, too late
    assert after.released == {pull.req_id}  # its reply ended the pull: blocks go back
    assert pull.req_id not in worker._mc_tasks
    assert not worker.failure_reporter.is_tracked(pull.req_id)


def test_two_kv_cache_groups_fail_by_request(fake_p: FakePrefill) -> None:
    """Block ids are per group, so failures go out as failed_recving only (C5, C6)."""
    conn = build_worker_connector("D-two-groups", num_groups=2)
    try:
        bad = make_pull(fake_p.url, "err", local_block_ids=[[1, 2], [1, 2]])
        good = make_pull(fake_p.url, "ok", local_block_ids=[[3], [3]])
        start(conn, bad, good)
        obs = poll(conn, {bad.req_id, good.req_id})
        assert obs.finished == Counter({bad.req_id: 1, good.req_id: 1})
        assert obs.failed == Counter({bad.req_id: 1})
        assert obs.failed_pass[bad.req_id] == obs.finished_pass[bad.req_id]  # paired (C6)
        assert not obs.invalid
    finally:
        conn.shutdown()


def test_watchdog_bounds_a_hung_bootstrap_and_no_pull_follows(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """The bootstrap query hangs past the deadline, then answers.

    The watchdog reports the load (upstream: up to 3 x 30 s); when the answer finally
    arrives, no pull may start for it: its blocks may already belong to another request
    and P would write into them (C11).
    """
    before = stage_counts(connector)
    slow = SlowBootstrap("P-slow-boot", fake_p.worker_addr(f"{ONE}/0"), DEADLINE_S + 1.0)
    try:
        pull = make_pull(slow.url, "ok", engine="P-slow-boot")
        start(connector, pull)
        obs = poll(connector, {pull.req_id}, timeout_s=DEADLINE_S + BOUND_S, settle_s=0.0)
        assert_failed_once(obs, pull)
        assert stage_counts(connector)[Stage.WATCHDOG] - before[Stage.WATCHDOG] == 1
        assert slow.answered.wait(timeout=BOUND_S)
        after = poll(connector, set(), timeout_s=0.5, settle_s=0.5)
        assert not after.finished and not after.invalid
        assert fake_p.exchanges_for(pull.req_id) == []  # no pull after the load ended
    finally:
        slow.close()


# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "overrides",
    [
        {"transfer_id": ""},
        {"remote_bootstrap_addr": "127.0.0.1:8998"},  # no scheme
        {"remote_bootstrap_addr": "http://127.0.0.1:notaport"},
        {"remote_engine_id": 42},
        {"engine_key": UNUSABLE_ENGINE},  # what the scheduler half forwards
    ],
    ids=["no-transfer-id", "no-scheme", "bad-port", "engine-not-str", "scheduler-rejected"],
)
def test_malformed_params_are_reported_not_raised(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill, overrides: dict[str, Any]
) -> None:
    before = stage_counts(connector)
    pull = make_pull(fake_p.url, "ok", **overrides)
    start(connector, pull)  # must not raise
    assert_failed_once(poll(connector, {pull.req_id}), pull)
    assert stage_counts(connector)[Stage.PARAMS] - before[Stage.PARAMS] == 1


def test_notify_only_pull_is_never_reported(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    """No local blocks (an abort_immediately request): P is told, the scheduler is not."""
    pull = make_pull(fake_p.url, "ok", n_blocks=0)
    bad = make_pull(fake_p.url, "ok", n_blocks=0, transfer_id="")
    start(connector, pull, bad)
    obs = poll(connector, set(), timeout_s=1.0, settle_s=1.0)
    assert not obs.finished and not obs.invalid  # C7
    assert fake_p.exchanges_for(pull.req_id)  # P was still asked, to free its blocks


# ---------------------------------------------------------------------------- stats


def test_stage_counters_reach_get_kv_connector_stats(
    connector: KvfailMooncakeConnector, fake_p: FakePrefill
) -> None:
    connector.get_kv_connector_stats()  # start a fresh interval
    bad_params = make_pull(fake_p.url, "ok", transfer_id="")
    peer_err = make_pull(fake_p.url, "err")
    start(connector, bad_params, peer_err)
    poll(connector, {bad_params.req_id, peer_err.req_id})
    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, KvfailMooncakeStats)
    summary = stats.reduce()
    assert summary["stage.params"] == 1 and summary["stage.peer"] == 1
    assert summary["loads_failed"] == 2
    assert summary["Num failed recvs"] == 2  # upstream's counter, fed by the tracker
    # What vLLM's logger does with the payload, aggregated across two workers.
    rebuilt = KvfailMooncakeConnector.build_kv_connector_stats(stats.to_dict())
    assert rebuilt is not None
    twice = rebuilt.aggregate(KvfailMooncakeConnector.build_kv_connector_stats(stats.to_dict()))
    assert twice.reduce()["stage.params"] == 2 and twice.reduce()["Num failed recvs"] == 4
    assert connector.get_kv_connector_stats() is None  # nothing new this interval


def test_stats_class_edge_cases() -> None:
    empty = KvfailMooncakeConnector.build_kv_connector_stats({})
    assert empty is not None and empty.is_empty()
    only_ours = KvfailMooncakeStats(data={"kvfail.stage.bootstrap": 3})
    assert not only_ours.is_empty()
    assert only_ours.reduce()["stage.bootstrap"] == 3
    assert only_ours.reduce()["Num failed recvs"] == 0
    snapshot = only_ours.clone_and_reset()
    assert isinstance(snapshot, KvfailMooncakeStats) and only_ours.is_empty()
    assert snapshot.kvfail_counters() == {"stage.bootstrap": 3}


# ---------------------------------------------------------------------------- real Scheduler


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_scheduler_forwards_malformed_params_to_a_reported_failure(
    fake_p: FakePrefill, policy: str
) -> None:
    """Through the real Scheduler: no crash, nothing stranded, the policy decides.

    Upstream 0.32.0 strands a request missing a key in WAITING_FOR_REMOTE_KVS, and
    raises in build_connector_meta for an unhashable remote_engine_id.
    """
    base = {"do_remote_prefill": True, "do_remote_decode": False}
    good = {**base, "transfer_id": "ok-sched", "remote_engine_id": ONE}
    cases = {
        "missing-transfer-id": {
            **base,
            "remote_engine_id": ONE,
            "remote_bootstrap_addr": fake_p.url,
        },
        "no-scheme": {**good, "remote_bootstrap_addr": fake_p.url.removeprefix("http://")},
        "engine-unhashable": {
            **good,
            "remote_engine_id": [ONE],
            "remote_bootstrap_addr": fake_p.url,
        },
        "good": {**good, "remote_bootstrap_addr": fake_p.url},
    }
    spec = EngineSpec(
        role="consumer",
        connector="KvfailMooncakeConnector",
        connector_module="connectors.mooncake",
        engine_id=f"D-sched-{policy}",
        policy=policy,  # type: ignore[arg-type]
        extra_config=EXTRA,
    )
    with Engine(spec) as engine:
        for name, params in cases.items():
            engine.add_request(name, prompt_len=70, max_tokens=2, kv_transfer_params=params)
        result = engine.run_until_idle(timeout_s=BOUND_S, poll_s=0.01)
        assert result.ok, (result, engine.record.crashes)
        assert not engine.record.crashes
        reasons = {o.request_id: o.finish_reason for o in engine.record.outputs if o.finish_reason}
        worker = engine.workers[0].connector.connector_worker
        assert worker.failure_stats()["stage.params"] == 3
        for name in cases:
            assert engine.record.load_episodes(name) == 1  # C12: no re-load after a failure
        expected_bad = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
        assert reasons == {
            "missing-transfer-id": expected_bad,
            "no-scheme": expected_bad,
            "engine-unhashable": expected_bad,
            "good": FinishReason.LENGTH,
        }


def test_a_lost_p_worker_makes_its_engines_be_looked_up_again(
    connector: KvfailMooncakeConnector,
) -> None:
    """A P restarted under the same engine id listens on new ports; upstream caches P's
    worker addresses per engine id for D's lifetime. Losing a worker must drop exactly
    the engines that used it (found in the e2e tier: D kept dialling a dead P)."""
    worker = connector.connector_worker
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
