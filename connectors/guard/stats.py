"""The guard's stats: the inner connector's own stats, carried whole, plus kvfail's.

Why nested and not merged: the guard wraps any connector, whose stats class it does not
know in advance (Mooncake keeps lists, NIXL histograms, MultiConnector one object per
child). vLLM rebuilds stats from a dict with the guard's classmethod alone, so the inner
part travels with the path of the class that can rebuild it, and every operation on it
(aggregate, reduce, the inner's Prometheus ``observe``) is the inner class's own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvfail.vllm_stats import PREFIX, KvfailPromMetrics, KVFailStats

__all__ = ["INNER_CLASS_KEY", "INNER_KEY", "GuardPromMetrics", "GuardStats", "class_path"]

#: The inner connector's stats (an object in-process, its ``to_dict()`` across processes).
INNER_KEY = "inner"
#: ``module:Class`` of the inner connector, whose classmethod rebuilds :data:`INNER_KEY`.
INNER_CLASS_KEY = "inner_class"


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class GuardStats(KVConnectorStats):
    """``kvfail.*`` counters and gauges at top level; the inner's stats under ``inner``."""

    @classmethod
    def wrap(
        cls, inner: KVConnectorStats | None, inner_cls: type, ours: KVFailStats | None
    ) -> GuardStats | None:
        """This interval's stats, or None when neither part recorded anything."""
        if (inner is None or inner.is_empty()) and (ours is None or ours.is_empty()):
            return None
        data: dict[str, Any] = dict(ours.data) if ours is not None else {}
        if inner is not None:
            data[INNER_KEY] = inner
            data[INNER_CLASS_KEY] = class_path(inner_cls)
        return cls(data=data)

    def inner(self) -> KVConnectorStats | None:
        value = self.data.get(INNER_KEY)
        if value is None or isinstance(value, KVConnectorStats):
            return value
        rebuilt = _import_class(self.data[INNER_CLASS_KEY]).build_kv_connector_stats(data=value)
        self.data[INNER_KEY] = rebuilt
        return rebuilt  # type: ignore[no-any-return]

    def ours(self) -> KVFailStats:
        return KVFailStats(data={k: v for k, v in self.data.items() if k.startswith(PREFIX)})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> GuardStats:
        merged = self.ours().aggregate(KVFailStats(data=dict(other.data)))
        mine = self.inner()
        theirs = other.inner() if isinstance(other, GuardStats) else None
        if mine is None and theirs is not None:
            self.data[INNER_CLASS_KEY] = other.data[INNER_CLASS_KEY]
            mine = theirs
        elif mine is not None and theirs is not None:
            mine = mine.aggregate(theirs)
        self.data = {k: v for k, v in self.data.items() if not k.startswith(PREFIX)}
        self.data.update(merged.data)
        if mine is not None:
            self.data[INNER_KEY] = mine
        return self

    def reduce(self) -> dict[str, int | float]:
        inner = self.inner()
        summary = dict(inner.reduce()) if inner is not None else {}
        summary.update(self.ours().reduce())
        return summary

    def is_empty(self) -> bool:
        inner = self.inner()
        return self.ours().is_empty() and (inner is None or inner.is_empty())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.ours().data)
        inner = self.inner()
        if inner is not None:
            out[INNER_KEY] = inner.to_dict()
            out[INNER_CLASS_KEY] = self.data[INNER_CLASS_KEY]
        return out


class GuardPromMetrics(KVConnectorPromMetrics):
    """kvfail's metrics on the top-level keys, the inner's on the inner part."""

    def __init__(self, ours: KvfailPromMetrics, inner: KVConnectorPromMetrics | None) -> None:
        self.ours = ours
        self.inner_metrics = inner
        self.per_engine_labelvalues = ours.per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.ours.observe(transfer_stats_data, engine_idx)
        inner = transfer_stats_data.get(INNER_KEY)
        if self.inner_metrics is not None and inner:
            if isinstance(inner, KVConnectorStats):
                inner = inner.to_dict()
            self.inner_metrics.observe(inner, engine_idx)
