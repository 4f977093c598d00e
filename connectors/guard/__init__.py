"""kvfail's load-error contract around any vLLM KV connector, by configuration.

``KVTransferConfig(kv_connector="KvfailGuardConnector",
kv_connector_module_path="connectors.guard", kv_connector_extra_config={"inner": ...})``;
see :mod:`connectors.guard.connector` and docs/guard.md. Importing this package imports
vLLM (and pydantic, which comes with it); ``import kvfail`` imports neither.
"""

from connectors.guard.config import DEFAULT_DEADLINE_S, GuardConfig, GuardConfigError
from connectors.guard.connector import GuardLoad, GuardMetadata, KvfailGuardConnector

__all__ = [
    "DEFAULT_DEADLINE_S",
    "GuardConfig",
    "GuardConfigError",
    "GuardLoad",
    "GuardMetadata",
    "KvfailGuardConnector",
]
