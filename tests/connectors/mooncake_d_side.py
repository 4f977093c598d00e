"""The D side of the Mooncake unit tests: D's worker connector, the pulls they start, the
polling that plays the model runner, and the checks every failure test makes.

Why one module: every ``test_mooncake_*`` module that drives the real worker against
:class:`tests.connectors.fake_mooncake_p.FakePrefill` builds D, scripts pulls and reads
its results the same way. Its fixtures are in ``tests/connectors/conftest.py``.

D's WORKER connector is built the way vLLM builds it (the factory,
``kv_connector_module_path="connectors.mooncake"``), in a real gloo world of one, with real
KV tensors registered with Mooncake.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # get_ip() must answer loopback
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorMetadata,
    PullReqMeta,
)
from vllm.v1.worker.utils import allocate_kv_cache

from connectors.mooncake import KvfailMooncakeConnector, KvfailMooncakeWorker
from kvfail import Stage
from kvfail.harness.config import EngineSpec, build_config
from kvfail.harness.workers import ensure_world_of_one
from kvfail.vllm_quarantine import KvfailWorkerMeta
from tests.connectors.fake_mooncake_p import ONE

DEADLINE_S = 1.5
#: Generous bound for anything that should take well under a second on a busy machine.
BOUND_S = 15.0
EXTRA = {"mooncake_protocol": "tcp", "kvfail_deadline_s": DEADLINE_S}
NUM_BLOCKS = 64


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


#: One count for the session, so ids and blocks stay distinct across test modules.
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


def start(conn: KvfailMooncakeConnector, *pulls: Pull, deadline_s: float = BOUND_S) -> None:
    """What the model runner does with one step's metadata.

    ``deadline_s`` replaces D's :data:`DEADLINE_S` for these loads only (it is read when a
    load is tracked). By default it is :data:`BOUND_S`: a load that P's answer ends must
    not lose the race to the deadline on a busy machine. A test of the deadline itself
    passes :data:`DEADLINE_S`."""
    meta = MooncakeConnectorMetadata()
    for pull in pulls:
        meta.reqs_to_recv[pull.engine_key][pull.req_id] = pull.meta
    tracker = worker_of(conn).failure_reporter
    default = tracker.default_deadline_s
    tracker.default_deadline_s = deadline_s
    try:
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)  # type: ignore[arg-type]
        conn.clear_connector_metadata()
    finally:
        tracker.default_deadline_s = default


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


def assert_each_fails_once(
    conn: KvfailMooncakeConnector, *pulls: Pull
) -> tuple[Observed, Counter[Stage]]:
    """Start ``pulls`` (with :func:`start`'s bound), poll until each finished and check
    each failed exactly once. Returns what was observed and the failures each stage
    counted meanwhile: the stage a failure was detected at is what most failure tests
    check next."""
    before = stage_counts(conn)
    start(conn, *pulls)
    obs = poll(conn, {pull.req_id for pull in pulls})
    for pull in pulls:
        assert_failed_once(obs, pull)
    counted = stage_counts(conn)
    counted.subtract(before)
    return obs, counted


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
