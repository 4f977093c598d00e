"""``KvfailMooncakeConnector``: upstream's MooncakeConnector with kvfail's failure reporting.

Load it into vLLM with::

    KVTransferConfig(kv_connector="KvfailMooncakeConnector",
                     kv_connector_module_path="connectors.mooncake", ...)

Everything upstream does is kept (bootstrap, side channel, P-push transfers, HMA); the
scheduler half forwards unusable pulls to the worker (:mod:`connectors.mooncake.scheduler`)
and the worker half reports every D-side outcome through
:class:`kvfail.FailureReporterMixin` (:mod:`connectors.mooncake.worker`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
)

from connectors.config import MooncakeKvfailConfig, validate_extra_config
from connectors.mooncake.scheduler import KvfailMooncakeScheduler
from connectors.mooncake.stats import KvfailMooncakeStats
from connectors.mooncake.worker import DEFAULT_DEADLINE_S, KvfailMooncakeWorker
from kvfail.compat import KVConnectorTransferResults, make_transfer_results
from kvfail.deadline import DEADLINE_KEY, seconds_from
from kvfail.vllm_quarantine import QuarantineConnector
from kvfail.vllm_stats import KvfailMetricsConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KvfailMooncakeConnector(QuarantineConnector, KvfailMetricsConnector, MooncakeConnector):
    """Upstream's connector, built with our scheduler and worker halves; the scheduler
    half holds a failed pull's blocks while P may still push (:mod:`kvfail.quarantine`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        validate_extra_config(
            getattr(transfer, "kv_connector_extra_config", None), MooncakeKvfailConfig
        )
        # Upstream's __init__ names its own worker class, and building that one starts a
        # TransferEngine and threads, so it cannot be built and then replaced. We run the
        # base initialiser and set the same three attributes with our classes.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None and transfer_config.engine_id is not None
        self.engine_id: str = transfer_config.engine_id
        #: The load deadline the worker enforces, declared for the conformance suite.
        self.kv_load_deadline_s = seconds_from(
            transfer_config.kv_connector_extra_config, DEADLINE_KEY, DEFAULT_DEADLINE_S
        )
        self.connector_scheduler: KvfailMooncakeScheduler | None = None
        self.connector_worker: KvfailMooncakeWorker | None = None  # type: ignore[assignment]
        if role == KVConnectorRole.SCHEDULER:
            assert kv_cache_config is not None, "kv_cache_config is required for SCHEDULER role"
            self.connector_scheduler = KvfailMooncakeScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvfailMooncakeWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    # Both channels are the worker's, on every vLLM. Older upstream connectors delegate
    # only ``get_finished`` (vLLM's default ``get_transfer_results`` then drops
    # ``failed_recving``) or neither (the base's ``get_block_ids_with_load_errors`` is an
    # empty set): without these two, failures the worker reports would never leave it.

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The worker's results, ``failed_recving`` included."""
        if self.connector_worker is None:
            return make_transfer_results()
        return self.connector_worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The completion poll of a vLLM without ``get_transfer_results``."""
        if self.connector_worker is None:
            return None, None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The worker's failed blocks (the one-group channel)."""
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Upstream leaves this to ``__del__``; stop the worker's threads when asked."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild stats holding upstream's metrics and kvfail's counters."""
        return KvfailMooncakeStats(data=dict(data) if data else {})
