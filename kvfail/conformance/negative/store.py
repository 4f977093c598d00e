"""Negative controls on store connectors: a store's load broken in ONE way each.

vLLM's ExampleConnector (files on local disk), driven by ExampleDriver with a P that
saves real files: ``SkipsStoreLoad`` breaks the load itself, the way the harness used to
make it look (the load is skipped with a warning and the step reports nothing), so only
the integrity oracle (D's positions against P's pattern) can tell; it is flagged in
``test_store_load_ok`` (C1 wrong KV), where the unbroken ExampleConnector passes
(``conformance/selftest/test_store_controls.py``). On kvfail's own Example connector
(``connectors/example``), ``SkipsDigestCheck`` loads each file without checking the digest
its save path wrote; ``test_store_data_overwritten`` flags it (C1 wrong KV), where
``KvfailExampleConnector`` passes. ``DropsChildErrors`` is vLLM's MultiConnector over two
of them that drops its children's reports; ``test_store_all_children_damaged`` flags it,
where the ``multi-example`` driver's MultiConnector passes. Each control's flag is in
:data:`EXPECTED_FLAGS_STORE`, its unbroken reference in :data:`STORE_REFERENCES`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from kvfail.conformance.negative.drops import DropsLoadErrors
from kvfail.conformance.negative.flag import Flag

__all__ = [
    "EXPECTED_FLAGS_STORE",
    "STORE_OPTIONS",
    "STORE_REFERENCES",
    "STORE_SELECT",
    "LoadsFromLastChild",
    "SkipsStoreLoad",
    "store_spec",
]

log = logging.getLogger("kvfail.conformance.negative")


class SkipsStoreLoad(ExampleConnector):
    """ExampleConnector that matches the stored prefix but never loads it: the scheduler
    counts the tokens as computed and D runs on blocks P's bytes never reached."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        log.warning("SkipsStoreLoad: load skipped (negative control)")


class LoadsFromLastChild(MultiConnector):
    """MultiConnector that routes a request's load to the LAST child that matches it,
    not the first: with every child holding P's bytes nothing shows, but a bystander
    child holding other bytes (``store_bystander_damaged``) is what D then runs on."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # vLLM turns the hybrid KV-cache manager off for a MultiConnector by its registry
        # name only (factory.supports_hma_config), so under another name its children's
        # refusal of HMA fails MultiConnector's own assertion. The harness builds one
        # full-attention group, where both managers behave the same: off, as for the
        # reference.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
        super().__init__(vllm_config, role, kv_cache_config)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        chosen: tuple[int | None, bool] = (0, False)
        for i, child in enumerate(self._connectors):
            tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False
            if tokens > 0:
                self._requests_to_connector[request.request_id] = i
                chosen = (tokens, load_async)
        return chosen


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector as _MooncakeStore,
    )
except Exception:  # the store's module is importable wherever vLLM is; be safe anyway
    _MooncakeStore = None

if _MooncakeStore is not None:

    class DropsStoreLoadErrors(DropsLoadErrors, _MooncakeStore):  # type: ignore[misc,valid-type]
        """MooncakeStoreConnector that drops what its receive threads found: a get that
        failed is reported as a finished load, with no failed block and no failed
        request, so D runs on blocks the store never filled."""

    __all__ += ["DropsStoreLoadErrors"]

try:
    from connectors.example import KvfailExampleConnector as _KvfailExample
except Exception:  # connectors/ is kvfail's own package; be safe anyway
    _KvfailExample = None

if _KvfailExample is not None:

    class SkipsDigestCheck(_KvfailExample):  # type: ignore[misc,valid-type]
        """kvfail's Example connector trusting whatever parses: each layer's file is
        read without checking it against the digest its save path wrote, so a file
        overwritten since (same format, other bytes) loads as a success."""

        def _read_layer(self, path: Any) -> Any:
            from safetensors.torch import load_file

            from connectors.example.connector import TENSOR_KEY

            return load_file(str(path))[TENSOR_KEY]

    class DropsChildErrors(DropsLoadErrors, MultiConnector):
        """MultiConnector that drops what its children report: a child's failed load
        goes out of the parent as a finished one, so D runs on blocks no file filled.
        Run over kvfail's Example children (the suite names them: :data:`STORE_OPTIONS`),
        whose failures are reported, so there is something to drop."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            # As LoadsFromLastChild: the hybrid manager is off only under Multi's name.
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
            super().__init__(vllm_config, role, kv_cache_config)

    __all__ += ["DropsChildErrors", "SkipsDigestCheck"]

#: Store-connector controls (``scenarios/test_store_faults.py``): class -> its flag.
EXPECTED_FLAGS_STORE: dict[str, Flag] = {
    "SkipsStoreLoad": Flag("test_store_load_ok", "C1 wrong KV"),
    "LoadsFromLastChild": Flag("test_store_bystander_damaged", "C1 wrong KV"),
    **(
        {"DropsStoreLoadErrors": Flag("test_store_lost_after_lookup", "C1 unreported")}
        if _MooncakeStore is not None
        else {}
    ),
    **(
        {
            "SkipsDigestCheck": Flag("test_store_data_overwritten", "C1 wrong KV"),
            "DropsChildErrors": Flag("test_store_all_children_damaged", "C1 unreported"),
        }
        if _KvfailExample is not None
        else {}
    ),
}
#: Each store control's unbroken reference (a ``--connector`` value): judged on the
#: scenario that flags the control without the control's finding, or the flag is no
#: evidence (``reference_problems``).
STORE_REFERENCES: dict[str, str] = {
    "SkipsStoreLoad": "vllm:ExampleConnector",
    "LoadsFromLastChild": "vllm:MultiConnector",
    "DropsStoreLoadErrors": "vllm:MooncakeStoreConnector",
    "SkipsDigestCheck": "example",
    "DropsChildErrors": "multi-example",
}
#: The ``--connector`` options the suite gives a store control's driver: the set-up comes
#: from the suite, never from the class under test.
STORE_OPTIONS: dict[str, str] = {
    "DropsChildErrors": "?children=connectors.example:KvfailExampleConnector",
}


def store_spec(control: str) -> str:
    """The ``--connector`` value that runs store control ``control``."""
    return f"kvfail.conformance.negative:{control}{STORE_OPTIONS.get(control, '')}"


#: A narrower selection (``-k``) than the whole flagging scenario, where one of its
#: parametrizations is evidence enough and each costs a fresh store.
STORE_SELECT: dict[str, str] = {
    "DropsStoreLoadErrors": "(test_store_lost_after_lookup and store_key_removed)",
}
