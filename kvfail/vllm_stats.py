"""kvfail's counters as a vLLM ``KVConnectorStats``, so they reach vLLM's stats logger.

This module imports vLLM; ``import kvfail`` does not import it. A connector returns
``KVFailStats.from_failure_stats(self.take_failure_stats())`` from
``get_kv_connector_stats`` (or merges the dict into its own stats) and returns
``KVFailStats(data=data)`` from ``build_kv_connector_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfail.stats import FailureStats

PREFIX = "kvfail."


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
            if key.startswith(PREFIX):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k.removeprefix(PREFIX): v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)
