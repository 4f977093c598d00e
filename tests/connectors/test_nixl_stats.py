"""Fast, in-process checks of KvfailNixlConnector's pieces that need vLLM but no nixl.

Why: vLLM rebuilds connector stats from plain ``data`` dicts and aggregates them across
workers and intervals through ``build_kv_connector_stats``; if the merged object mishandled
either half, kvfail's counters (or upstream's NIXL telemetry) would silently vanish or
crash the stats logger. The worker itself is exercised for real in ``test_nixl_unit.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def nixl() -> Any:
    import connectors.nixl as module

    return module


def _failures(**stages: int) -> Any:
    from kvfail.stages import Stage
    from kvfail.stats import FailureStats

    stats = FailureStats()
    for name, n in stages.items():
        stats.failed_by_stage[Stage(name)] += n
        stats.events["loads_failed"] += n
    return stats


def test_merged_keeps_upstream_lists_and_kvfail_counters(nixl: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    upstream = NixlKVConnectorStats()
    upstream.record_failed_handshake()
    merged = nixl.KvfailNixlStats.merged(upstream, _failures(handshake=1))
    assert merged.data["num_failed_handshakes"] == [1]
    assert merged.data["kvfail.stage.handshake"] == 1
    assert merged.kvfail_counters()["stage.handshake"] == 1
    assert not merged.is_empty()
    assert nixl.KvfailNixlStats.merged(None, _failures()) is None


def test_rebuilt_from_data_and_aggregated_across_workers(nixl: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    a = nixl.KvfailNixlStats.merged(None, _failures(watchdog=1))
    upstream = NixlKVConnectorStats()
    upstream.record_failed_transfer()
    b = nixl.KvfailNixlStats.merged(upstream, _failures(transfer=2))
    # As vLLM does between processes: only the data dict travels.
    rebuilt = nixl.KvfailNixlConnector.build_kv_connector_stats(data=dict(a.data))
    total = rebuilt.aggregate(nixl.KvfailNixlConnector.build_kv_connector_stats(data=b.data))
    assert total.data["num_failed_transfers"] == [1]
    assert total.data["kvfail.stage.watchdog"] == 1
    assert total.data["kvfail.stage.transfer"] == 2
    assert total.data["kvfail.loads_failed"] == 3
    reduced = total.reduce()
    assert reduced["Num failed transfers"] == 1  # upstream's CLI summary still works
    assert reduced["kvfail stage.transfer"] == 2


def test_plain_upstream_stats_aggregate_into_merged(nixl: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    upstream = NixlKVConnectorStats()
    upstream.record_failed_notification()
    total = nixl.KvfailNixlConnector.build_kv_connector_stats().aggregate(upstream)
    assert total.data["num_failed_notifications"] == [1]
    assert total.kvfail_counters() == {}


def test_empty_merged_stats_are_empty(nixl: Any) -> None:
    assert nixl.KvfailNixlConnector.build_kv_connector_stats().is_empty()
    assert nixl.KvfailNixlConnector.build_kv_connector_stats(data={}).is_empty()


def test_notification_failures_do_not_fail_the_load(nixl: Any) -> None:
    from kvfail.stages import Stage

    assert "notification_failed" not in nixl.FAILURE_STAGES
    assert nixl.FAILURE_STAGES["handshake_failed"] is Stage.HANDSHAKE
    assert nixl.FAILURE_STAGES["transfer_setup_failed"] is Stage.TRANSFER_SETUP
    assert nixl.FAILURE_STAGES["transfer_failed"] is Stage.TRANSFER


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 30.0),
        ({"kvfail_deadline_s": 2}, 2.0),
        ({"kvfail_deadline_s": None}, None),
        ({"kvfail_deadline_s": 0}, None),
    ],
)
def test_deadline_from_extra_config(nixl: Any, extra: dict, expected: float | None) -> None:
    from vllm.config import KVTransferConfig, VllmConfig

    from connectors.nixl.connector import _deadline_from

    config = VllmConfig.__new__(VllmConfig)  # only kv_transfer_config is read
    object.__setattr__(
        config,
        "kv_transfer_config",
        KVTransferConfig(
            kv_connector="KvfailNixlConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config=extra,
        ),
    )
    assert _deadline_from(config) == expected


@pytest.mark.parametrize("record", [True, False])
def test_the_failed_transfer_override_passes_upstream_only_what_it_accepts(record: bool) -> None:
    # vLLM 0.30's _handle_failed_transfer has no record_failed_transfer: forwarding the
    # default positionally crashed every failure path of kvfail's NIXL on that release.
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    from connectors.nixl.connector import failed_transfer_kwargs

    upstream = inspect.signature(NixlBaseConnectorWorker._handle_failed_transfer)
    kwargs = failed_transfer_kwargs(record)
    if not record and "record_failed_transfer" not in upstream.parameters:
        pytest.skip("this vLLM never passes record_failed_transfer=False")
    upstream.bind(object(), "req", None, set(), **kwargs)
    assert kwargs == ({} if record else {"record_failed_transfer": False})
