"""The guard's stats carry the inner's own stats whole, and kvfail's counters and
quarantine gauges beside them, across vLLM's dict round trip and onto ``/metrics``."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the stats classes are vLLM's")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (  # noqa: E402
    MooncakeKVConnectorStats,
)

from connectors.guard import KvfailGuardConnector  # noqa: E402
from connectors.guard.stats import INNER_KEY, GuardStats  # noqa: E402
from kvfail import Stage  # noqa: E402
from kvfail.stats import StatsRecorder  # noqa: E402
from kvfail.vllm_stats import GAUGE_PREFIX, KVFailStats  # noqa: E402

pytestmark = pytest.mark.vllm


def _ours() -> KVFailStats:
    rec = StatsRecorder()
    rec.event("loads_tracked", 2)
    rec.failed(Stage.WATCHDOG)
    stats = KVFailStats.from_failure_stats(rec.take_interval())
    assert stats is not None
    return stats


def _inner() -> MooncakeKVConnectorStats:
    stats = MooncakeKVConnectorStats()
    stats.record_failed_recv()
    return stats


def test_nothing_recorded_is_no_stats() -> None:
    assert GuardStats.wrap(None, MooncakeConnector, None) is None
    assert GuardStats.wrap(MooncakeKVConnectorStats(), MooncakeConnector, None) is None


def test_round_trip_through_the_dict_vllm_sends() -> None:
    stats = GuardStats.wrap(_inner(), MooncakeConnector, _ours())
    assert stats is not None
    rebuilt = KvfailGuardConnector.build_kv_connector_stats(data=stats.to_dict())
    assert isinstance(rebuilt.inner(), MooncakeKVConnectorStats)
    summary = rebuilt.reduce()
    assert summary["stage.watchdog"] == 1 and summary["loads_tracked"] == 2
    assert summary["Num failed recvs"] == 1


def test_aggregate_adds_counts_and_the_inner_by_its_own_rule() -> None:
    a = GuardStats.wrap(_inner(), MooncakeConnector, _ours())
    b = GuardStats.wrap(_inner(), MooncakeConnector, _ours())
    assert a is not None and b is not None
    gauges = KVFailStats(data={GAUGE_PREFIX + "quarantined_blocks": 4})
    merged = a.aggregate(b).aggregate(gauges)
    summary = merged.reduce()
    assert summary["stage.watchdog"] == 2 and summary["Num failed recvs"] == 2
    assert summary["gauge.quarantined_blocks"] == 4


def test_metrics_show_the_guards_counters_and_holds_and_the_inners() -> None:
    registry = CollectorRegistry()
    types = {m: functools.partial(m, registry=registry) for m in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KvfailGuardConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    stats = GuardStats.wrap(None, MooncakeConnector, _ours())
    assert stats is not None
    data: dict[str, Any] = stats.to_dict()
    data[GAUGE_PREFIX + "quarantined_blocks"] = 3
    data["kvfail.lookups_timed_out"] = 1
    data["kvfail.lookups_refused_stuck"] = 4
    metrics.observe(data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:kvfail_loads_failed_total", stage="watchdog") == 1
    assert value("vllm:kvfail_quarantined_blocks") == 3
    # The scheduler half's own counts: a stuck lookup, and those answered while it hung.
    assert value("vllm:kvfail_events_total", event="lookups_timed_out") == 1
    assert value("vllm:kvfail_events_total", event="lookups_refused_stuck") == 4
    assert INNER_KEY not in data
