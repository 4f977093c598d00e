"""Upstream's MooncakeConnector as a ``vllm serve`` server can load it on CPU-only torch.

Why this module: upstream's worker asks ``torch.accelerator.current_device_index()`` in its
constructor, which raises without an accelerator, so ``kv_connector="MooncakeConnector"``
cannot start on this machine. The subclass changes nothing but that: it constructs
upstream's connector inside the rig's ``cpu_accelerator_index`` shim (``kvfail.rig.cpu_shim``,
``docs/rig-patches.md``), the stand-in kvfail's own Mooncake worker is built in
(``kvfail.cpu``). Every method is upstream's. Load it with
``kv_connector="UpstreamMooncakeConnector", kv_connector_module_path="e2e.upstream"``
(``e2e.servers.kv_transfer_config`` does, for a server whose spec says ``impl="upstream"``).
Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
)

from kvfail.rig.cpu_shim import cpu_accelerator_index_shim

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


class UpstreamMooncakeConnector(MooncakeConnector):
    """Upstream's connector, unchanged once built; only its construction runs in the shim."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        with cpu_accelerator_index_shim():
            super().__init__(vllm_config, role, kv_cache_config)
