"""kvfail's counters as a vLLM ``KVConnectorStats``, so they reach vLLM's stats logger.

This module imports vLLM; ``import kvfail`` does not import it. A connector returns
``KVFailStats.from_failure_stats(self.take_failure_stats())`` from
``get_kv_connector_stats`` (or merges the dict into its own stats) and returns
``KVFailStats(data=data)`` from ``build_kv_connector_stats``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvfail.quarantine import BlockQuarantine
from kvfail.stages import Stage
from kvfail.stats import EVENT_COUNTERS, FailureStats

PREFIX = "kvfail."
#: Keys under this prefix are levels, not counts: aggregation keeps the latest value.
GAUGE_PREFIX = PREFIX + "gauge."
#: The quarantine's gauges (see :mod:`kvfail.quarantine`), by key suffix.
QUARANTINE_GAUGES: dict[str, str] = {
    "quarantined_blocks": "KV blocks held out of the free pool because a failed load's "
    "transfer may still write into them (kvfail).",
    "quarantined_loads": "Failed loads whose blocks are quarantined (kvfail).",
    "oldest_hold_age_seconds": "How long the oldest quarantined load has been held, in "
    "seconds; 0 when nothing is held (kvfail).",
}
#: Gauge keys under this prefix are held loads per P, the P's name after the prefix.
PEER_GAUGE_PREFIX = GAUGE_PREFIX + "held_loads."
PEER_GAUGE_DOC = "Quarantined loads per P they were loaded from (kvfail)."


def quarantine_gauges(
    quarantine: BlockQuarantine, refused_loads: int, gone_peers: Iterable[str] = ()
) -> dict[str, int | float]:
    """The scheduler side's stats dict: the quarantine's levels, the oldest hold's age,
    held loads per P (0 for ``gone_peers``, Ps whose holds all ended since the last
    dict), and the remote loads it turned away (computed locally) since the last one."""
    data: dict[str, int | float] = {
        GAUGE_PREFIX + "quarantined_blocks": quarantine.blocks_held,
        GAUGE_PREFIX + "quarantined_loads": len(quarantine),
        GAUGE_PREFIX + "oldest_hold_age_seconds": round(quarantine.oldest_age_s(), 1),
    }
    for peer in gone_peers:
        data[PEER_GAUGE_PREFIX + peer] = 0
    for peer, loads in quarantine.loads_by_peer().items():
        data[PEER_GAUGE_PREFIX + peer] = loads
    if refused_loads:
        data[PREFIX + "loads_refused_quarantine_full"] = refused_loads
    return data


@dataclass
class KVFailStats(KVConnectorStats):
    """Counters are sums, so aggregating workers and intervals is addition."""

    @classmethod
    def from_failure_stats(cls, stats: FailureStats) -> KVFailStats | None:
        if stats.empty:
            return None
        return cls(data={PREFIX + k: v for k, v in stats.as_dict().items() if v})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVFailStats:
        for key, value in other.data.items():
            if key.startswith(GAUGE_PREFIX):
                self.data[key] = value
            elif key.startswith(PREFIX):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k.removeprefix(PREFIX): v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        # A gauge at zero is news (the level fell): any gauge present makes it non-empty.
        return not any(v or k.startswith(GAUGE_PREFIX) for k, v in self.data.items())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


class KvfailPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvfail_loads_failed_total{stage=...}`` and friends on vLLM's ``/metrics``.

    vLLM feeds each connector's aggregated stats dict to ``observe``; we read only the
    ``kvfail.`` keys, so this composes with any upstream stats class (see
    :func:`with_kvfail_metrics`). Counters only: every kvfail figure is a count.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        extra_events: tuple[str, ...] = (),
    ) -> None:
        """``extra_events``: counters of a connector's own, beside kvfail's."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        failed = self._counter_cls(
            name="vllm:kvfail_loads_failed",
            documentation="KV loads that failed, once per request, by the stage that "
            "detected the failure (kvfail).",
            labelnames=[*labelnames, "stage"],
        )
        events = self._counter_cls(
            name="vllm:kvfail_events",
            documentation="kvfail load events: tracked, succeeded, watchdog fired, and "
            "reports refused as unknown, late or duplicate (never passed to the scheduler).",
            labelnames=[*labelnames, "event"],
        )
        self._failed = {
            (idx, stage.value): failed.labels(*values, stage.value)
            for idx, values in per_engine_labelvalues.items()
            for stage in Stage
        }
        self._events = {
            (idx, name): events.labels(*values, name)
            for idx, values in per_engine_labelvalues.items()
            for name in (*EVENT_COUNTERS, "loads_refused_quarantine_full", *extra_events)
        }
        self._gauges: dict[tuple[int, str], Any] = {}
        for name, doc in QUARANTINE_GAUGES.items():
            gauge = self._gauge_cls(
                name=f"vllm:kvfail_{name}", documentation=doc, labelnames=labelnames
            )
            for idx, values in per_engine_labelvalues.items():
                self._gauges[(idx, name)] = gauge.labels(*values)
        # Labelled by P as Ps appear in the stats.
        self._per_peer = self._gauge_cls(
            name="vllm:kvfail_held_loads",
            documentation=PEER_GAUGE_DOC,
            labelnames=[*labelnames, "peer"],
        )
        self._labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not key.startswith(PREFIX) or (not value and not key.startswith(GAUGE_PREFIX)):
                continue
            if key.startswith(PEER_GAUGE_PREFIX):
                values = self._labelvalues.get(engine_idx)
                if values is not None:
                    peer = key.removeprefix(PEER_GAUGE_PREFIX)
                    self._per_peer.labels(*values, peer).set(value)
                continue
            if key.startswith(GAUGE_PREFIX):
                level = self._gauges.get((engine_idx, key.removeprefix(GAUGE_PREFIX)))
                if level is not None:
                    level.set(value)
                continue
            name = key.removeprefix(PREFIX)
            if name.startswith("stage."):
                metric = self._failed.get((engine_idx, name.removeprefix("stage.")))
            else:
                metric = self._events.get((engine_idx, name))
            if metric is not None:
                metric.inc(value)


class _BothPromMetrics(KVConnectorPromMetrics):
    """Upstream's metrics and ours, observed from the same stats dict."""

    def __init__(self, parts: list[KVConnectorPromMetrics]) -> None:
        self.parts = parts
        self.per_engine_labelvalues = parts[0].per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for part in self.parts:
            part.observe(transfer_stats_data, engine_idx)


def with_kvfail_metrics(
    upstream: KVConnectorPromMetrics | None,
    vllm_config: Any,
    metric_types: dict[type[Any], type[Any]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVConnectorPromMetrics:
    """What a connector's ``build_prom_metrics`` returns: upstream's metrics plus ours."""
    ours = KvfailPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
    return ours if upstream is None else _BothPromMetrics([upstream, ours])


class KvfailMetricsConnector:
    """Mix in front of an upstream connector class: its ``build_prom_metrics`` then
    returns upstream's metrics plus kvfail's, so no connector repeats this wiring."""

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        upstream = super().build_prom_metrics(  # type: ignore[misc]
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return with_kvfail_metrics(
            upstream, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
