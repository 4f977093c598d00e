"""One stats object carrying upstream's NIXL telemetry and kvfail's per-stage counters.

vLLM asks a connector class for exactly one ``KVConnectorStats`` type
(``build_kv_connector_stats``), and rebuilds it from a plain ``data`` dict when stats
cross processes or are aggregated over workers. So both sets of numbers have to live in
one ``data`` dict: upstream's NIXL keys keep their list-of-observations format (so
``NixlPromMetrics.observe`` and the CLI summary keep working unchanged), and kvfail's
counters ride along as integer ``kvfail.*`` keys, summed on aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvfail.stats import FailureStats
from kvfail.vllm_stats import PREFIX, KVFailStats


def _split(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(upstream NIXL part, kvfail part) of a merged ``data`` dict."""
    nixl = {k: v for k, v in data.items() if not k.startswith(PREFIX)}
    ours = {k: v for k, v in data.items() if k.startswith(PREFIX)}
    return nixl, ours


@dataclass
class KvfailNixlStats(NixlKVConnectorStats):
    """``NixlKVConnectorStats`` plus ``kvfail.*`` counters in the same ``data`` dict.

    Upstream's methods assume every key holds a list; the overrides below hand them only
    the NIXL part and treat the kvfail part with :class:`KVFailStats` (sums).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        # A stats object rebuilt from kvfail-only data must still have every NIXL key:
        # upstream's is_empty/reduce/observe index them directly.
        for key in NixlKVConnectorStats().data:
            self.data.setdefault(key, [])

    @classmethod
    def merged(
        cls, nixl: KVConnectorStats | None, failures: FailureStats
    ) -> KvfailNixlStats | None:
        """Combine one interval's upstream stats and kvfail counters; None if both empty."""
        ours = KVFailStats.from_failure_stats(failures)
        if nixl is None and ours is None:
            return None
        data: dict[str, Any] = {k: list(v) for k, v in nixl.data.items()} if nixl else {}
        if ours is not None:
            data.update(ours.data)
        return cls(data=data)

    def kvfail_counters(self) -> dict[str, int | float]:
        """kvfail's counters without the prefix, e.g. ``{"stage.handshake": 1}``."""
        return KVFailStats(data=_split(self.data)[1]).reduce()

    def is_empty(self) -> bool:
        return super().is_empty() and KVFailStats(data=_split(self.data)[1]).is_empty()

    def aggregate(self, other: KVConnectorStats) -> KvfailNixlStats:
        nixl, ours = _split(other.data)
        if nixl:
            mine_nixl, mine_ours = _split(self.data)
            upstream = NixlKVConnectorStats(data=mine_nixl)
            upstream.aggregate(NixlKVConnectorStats(data=nixl))
            self.data = {**upstream.data, **mine_ours}
        if ours:
            summed = KVFailStats(data=_split(self.data)[1]).aggregate(KVFailStats(data=ours))
            self.data.update(summed.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        nixl, _ = _split(self.data)
        out = NixlKVConnectorStats(data=nixl).reduce()
        out.update({f"kvfail {k}": v for k, v in self.kvfail_counters().items()})
        return out
