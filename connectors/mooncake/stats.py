"""One ``KVConnectorStats`` carrying upstream Mooncake's metrics and kvfail's counters.

Why one class: vLLM rebuilds a connector's stats with a single classmethod,
``build_kv_connector_stats(data)``, and aggregates them across workers and intervals with
``aggregate``. Upstream's ``MooncakeKVConnectorStats`` keeps lists (one entry per event);
kvfail's ``KVFailStats`` keeps summed ints under a ``kvfail.`` prefix. This subclass holds
both in one ``data`` dict and treats each key by its kind, so upstream's summary
("Num failed recvs", transfer times) and kvfail's per-stage counters reach the same log
line and the same scheduler stats payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
    MooncakeKVConnectorStats,
)

from kvfail.stats import FailureStats
from kvfail.vllm_stats import PREFIX, KVFailStats


def _is_kvfail_key(key: str) -> bool:
    return key.startswith(PREFIX)


@dataclass
class KvfailMooncakeStats(MooncakeKVConnectorStats):
    """Upstream's list-valued metrics plus kvfail's ``kvfail.*`` integer counters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Data rebuilt from a payload may hold only kvfail keys; upstream's methods index
        # its own keys directly, so make sure every one of them exists.
        for key, empty in MooncakeKVConnectorStats().data.items():
            self.data.setdefault(key, list(empty))

    @classmethod
    def combine(
        cls, upstream: MooncakeKVConnectorStats | None, failures: FailureStats
    ) -> KvfailMooncakeStats | None:
        """This interval's stats, or None when neither side recorded anything."""
        ours = KVFailStats.from_failure_stats(failures)
        if ours is None and (upstream is None or upstream.is_empty()):
            return None
        data: dict[str, Any] = dict(upstream.data) if upstream is not None else {}
        if ours is not None:
            data.update(ours.data)
        return cls(data=data)

    def kvfail_counters(self) -> dict[str, int]:
        """kvfail's counters, keys without the prefix (``stage.watchdog``, ...)."""
        return KVFailStats(data=self._kvfail_part()).reduce()  # type: ignore[return-value]

    def _kvfail_part(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if _is_kvfail_key(k)}

    def reset(self) -> None:
        super().reset()  # replaces ``data`` with upstream's empty lists: kvfail keys go too

    def aggregate(self, other: KVConnectorStats) -> KvfailMooncakeStats:
        ours = {}
        for key, value in other.data.items():
            if _is_kvfail_key(key):
                ours[key] = value
            else:
                self.data.setdefault(key, []).extend(value)
        if ours:  # kvfail's own rule: counts add, levels (gauges) take the latest
            merged = KVFailStats(data=self._kvfail_part()).aggregate(KVFailStats(data=ours))
            self.data.update(merged.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary = super().reduce()
        summary.update(self.kvfail_counters())
        return summary

    def is_empty(self) -> bool:
        return super().is_empty() and KVFailStats(data=self._kvfail_part()).is_empty()

    def clone_and_reset(self) -> KvfailMooncakeStats:
        with self._lock:
            snapshot = {k: list(v) if isinstance(v, list) else v for k, v in self.data.items()}
            self.reset()
        return KvfailMooncakeStats(data=snapshot)
