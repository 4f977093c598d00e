"""kvfail's NIXL connectors: upstream's ``NixlPullConnector`` and ``NixlPushConnector`` on
the kvfail failure mixin.

Load with ``kv_connector="KvfailNixlConnector"`` (pull) or ``"KvfailNixlPushConnector"``
(push), ``kv_connector_module_path="connectors.nixl"``.
Importing this imports vLLM; the scheduler role needs no nixl package, the worker role does.
"""

from connectors.nixl.connector import (
    DEADLINE_KEY,
    DEFAULT_DEADLINE_S,
    FAILURE_STAGES,
    KvfailNixlConnector,
    KvfailNixlWorker,
)
from connectors.nixl.push import KvfailNixlPushConnector, KvfailNixlPushWorker
from connectors.nixl.stats import KvfailNixlStats

__all__ = [
    "DEADLINE_KEY",
    "DEFAULT_DEADLINE_S",
    "FAILURE_STAGES",
    "KvfailNixlConnector",
    "KvfailNixlPushConnector",
    "KvfailNixlPushWorker",
    "KvfailNixlStats",
    "KvfailNixlWorker",
]
