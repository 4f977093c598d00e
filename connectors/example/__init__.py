"""Upstream vLLM's ExampleConnector on kvfail's failure reporter, with a digest per file.

``KVTransferConfig(kv_connector="KvfailExampleConnector",
kv_connector_module_path="connectors.example", ...)``. Importing this package imports vLLM.
"""

from connectors.example.connector import (
    DIGEST_SUFFIX,
    KvfailExampleConnector,
    KvfailExampleMetadata,
    StoreError,
)

__all__ = ["DIGEST_SUFFIX", "KvfailExampleConnector", "KvfailExampleMetadata", "StoreError"]
