"""kvfail's per-stage counters reach Prometheus through vLLM's connector metrics hook."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the metrics hook is vLLM's")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvfail import Stage  # noqa: E402
from kvfail.stats import StatsRecorder  # noqa: E402

pytestmark = pytest.mark.vllm

LABELS = ["model_name", "engine"]


def _metric_types(registry: CollectorRegistry) -> dict[type[Any], Any]:
    return {m: functools.partial(m, registry=registry) for m in (Gauge, Counter, Histogram)}


def _interval() -> dict[str, int]:
    rec = StatsRecorder()
    rec.event("loads_tracked", 3)
    rec.failed(Stage.WATCHDOG)
    rec.failed(Stage.PEER_LOST)
    rec.event("unknown_reports")
    from kvfail.vllm_stats import KVFailStats

    stats = KVFailStats.from_failure_stats(rec.take_interval())
    assert stats is not None
    return stats.data


@pytest.mark.parametrize("module", ["connectors.mooncake", "connectors.nixl"])
def test_connector_exposes_kvfail_counters(module: str) -> None:
    import importlib

    cls = {
        "connectors.mooncake": "KvfailMooncakeConnector",
        "connectors.nixl": "KvfailNixlConnector",
    }[module]
    connector = getattr(importlib.import_module(module), cls)
    registry = CollectorRegistry()
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = connector.build_prom_metrics(
        config, _metric_types(registry), LABELS, {0: ["tiny", "0"]}
    )
    data = _interval()
    # Upstream NIXL's own observe() expects its list-valued keys; give it empty ones.
    for key in (
        "transfer_duration",
        "post_duration",
        "bytes_transferred",
        "num_descriptors",
        "num_failed_transfers",
        "num_failed_notifications",
        "num_kv_expired_reqs",
        "num_notifications_after_expiry",
        "num_failed_handshakes",
    ):
        data.setdefault(key, [])
    metrics.observe(data, 0)
    metrics.observe(data, 0)  # per-interval deltas accumulate

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:kvfail_loads_failed_total", stage="watchdog") == 2
    assert value("vllm:kvfail_loads_failed_total", stage="peer_lost") == 2
    assert value("vllm:kvfail_loads_failed_total", stage="transfer") == 0
    assert value("vllm:kvfail_events_total", event="unknown_reports") == 2
    assert value("vllm:kvfail_events_total", event="loads_tracked") == 6


def test_held_loads_per_p_and_the_oldest_hold_reach_prometheus() -> None:
    from kvfail.vllm_stats import KvfailPromMetrics

    registry = CollectorRegistry()
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KvfailPromMetrics(config, _metric_types(registry), LABELS, {0: ["tiny", "0"]})
    metrics.observe(
        {
            "kvfail.gauge.oldest_hold_age_seconds": 12.5,
            "kvfail.gauge.held_loads.10.0.0.7:5600": 3,
        },
        0,
    )
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvfail_oldest_hold_age_seconds", labels) == 12.5
    assert (
        registry.get_sample_value("vllm:kvfail_held_loads", {**labels, "peer": "10.0.0.7:5600"})
        == 3
    )
    metrics.observe({"kvfail.gauge.held_loads.10.0.0.7:5600": 0}, 0)  # that P's holds ended
    assert (
        registry.get_sample_value("vllm:kvfail_held_loads", {**labels, "peer": "10.0.0.7:5600"})
        == 0
    )
