"""Feature detection of the installed vLLM, done lazily so ``import kvfail`` stays cheap.

The request-level channel (``get_transfer_results`` / ``KVConnectorTransferResults``)
arrived in vLLM 0.30.0; block-level reports with several KV-cache groups raise inside the
engine from 0.31.0. We detect rather than compare version strings, so backports and
forks are judged by what they actually offer.
"""

from __future__ import annotations

import functools
from typing import Any

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@functools.cache
def transfer_results_class() -> type[Any] | None:
    """vLLM's ``KVConnectorTransferResults``, or None when vLLM lacks it (or is absent)."""
    try:
        module = __import__(_BASE, fromlist=["KVConnectorTransferResults"])
    except ImportError:
        return None
    base = getattr(module, "KVConnectorBase_V1", None)
    if base is None or not hasattr(base, "get_transfer_results"):
        return None
    return getattr(module, "KVConnectorTransferResults", None)


def request_level_channel_available() -> bool:
    return transfer_results_class() is not None


class UnsupportedLayoutError(RuntimeError):
    """Raised at construction when failures in this KV layout could not be reported."""


@functools.cache
def block_pool_binding_available() -> bool:
    """Whether vLLM hands the connector its block pool (``bind_kv_cache_manager``): what
    :mod:`kvfail.quarantine` needs to hold a failed load's blocks. Without it a load that
    may still be written is held back until fenced, as before quarantine."""
    try:
        module = __import__(_BASE, fromlist=["KVConnectorBase_V1"])
    except ImportError:
        return False
    return hasattr(getattr(module, "KVConnectorBase_V1", None), "bind_kv_cache_manager")
