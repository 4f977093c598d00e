"""Upstream vLLM's MooncakeConnector on kvfail's failure reporter.

``KVTransferConfig(kv_connector="KvfailMooncakeConnector",
kv_connector_module_path="connectors.mooncake", ...)``. Importing this package imports
vLLM; the Mooncake transfer engine is needed only by the worker role.
"""

from connectors.mooncake.connector import KvfailMooncakeConnector
from connectors.mooncake.scheduler import KvfailMooncakeScheduler
from connectors.mooncake.stats import KvfailMooncakeStats
from connectors.mooncake.worker import DEFAULT_DEADLINE_S, KvfailMooncakeWorker

__all__ = [
    "DEFAULT_DEADLINE_S",
    "KvfailMooncakeConnector",
    "KvfailMooncakeScheduler",
    "KvfailMooncakeStats",
    "KvfailMooncakeWorker",
]
