"""Connector classes for the claim tests (``test_claims.py``): each does what some driver's
transport does under a name, module and ancestry of its own, or does nothing a driver
drives. Imported by ``module:Class`` like any user's connector; none is ever built here
(a probe reads code, it does not run it)."""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
    MooncakeConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector


class RenamedMooncake(MooncakeConnector):
    """Upstream's Mooncake connector under another name, in another module."""


class RenamedExample(ExampleConnector):
    """Upstream's Example connector under another name, in another module."""


class PullsOverMooncake(KVConnectorBase_V1):
    """No Mooncake ancestor: its constructor builds upstream's Mooncake worker (which
    opens a ``TransferEngine``), as a third party's wrapper would."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.worker = MooncakeConnectorWorker(vllm_config, "engine", kv_cache_config)


class FilesOnDisk(KVConnectorBase_V1):
    """No Example ancestor: reads a directory from the same extra-config key, and its
    lookup checks for a prompt's files there."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.root = config.get_from_extra_config("shared_storage_path", "/tmp")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if not os.path.exists(os.path.join(self.root, request.request_id)):
            return 0, False
        return len(request.prompt_token_ids) - 1 - num_computed_tokens, False


class SavesOnly(KVConnectorBase_V1):
    """Reads the same directory key but never looks anything up there (saves only)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.root = config.get_from_extra_config("shared_storage_path", "/tmp")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False


class ToyLike(KVConnectorBase_V1):
    """No toy ancestor: reads the toy transport's mode key."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.mode = vllm_config.kv_transfer_config.kv_connector_extra_config.get("toy_mode")


class TwoTransports(FilesOnDisk):
    """Reads the keys of two transports: two drivers claim it, and neither may win."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.mode = vllm_config.kv_transfer_config.kv_connector_extra_config.get("toy_mode")


class NoTransport(KVConnectorBase_V1):
    """Builds and reads nothing a driver drives."""


class PicksItsOwnChildren(MultiConnector):
    """A Multi connector naming the children it would like: the rig must not listen."""

    CONFORMANCE_CHILD = ("KvfailExampleConnector", "connectors.example")
