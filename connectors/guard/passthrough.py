"""A connector that hands every call of vLLM's connector API to an inner connector.

Why a class of its own: the guard (:mod:`connectors.guard.connector`) adds to a few of
these calls, and :class:`kvfail.vllm_quarantine.QuarantineConnector` to others, each by
calling ``super()``; this class is where every such chain ends, as vLLM's MultiConnector
delegates to its children. A subclass sets ``_guard_inner`` (the inner connector
instance) and ``_guard_inner_cls`` before vLLM calls anything, and may add its own
stats with :meth:`_guard_own_stats`.

Anything not in vLLM's API (an attribute a driver or a tool reads, such as
``connector_worker``) is read from the inner connector too (``__getattr__``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from connectors.guard.stats import GuardStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvfail.vllm_stats import KVFailStats

__all__ = ["PassThroughConnector", "inner_metadata"]


def inner_metadata(metadata: Any) -> Any:
    """The inner's part of a guard's metadata (anything else is the inner's already)."""
    return getattr(metadata, "inner", metadata) if hasattr(metadata, "loads") else metadata


class PassThroughConnector(KVConnectorBase_V1):
    """Every base method, forwarded to ``self._guard_inner``."""

    _guard_inner: KVConnectorBase_V1
    _guard_inner_cls: type

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_guard_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def _guard_own_stats(self) -> KVFailStats | None:
        """The wrapper's own counters for this interval (none here)."""
        return None

    def _guard_scheduler_call(self, what: str, call: Any, fallback: Any) -> Any:
        """A scheduler-side call into the inner that may wait on a remote; a subclass may
        bound it and answer ``fallback`` instead (here: called as it is)."""
        return call()

    # ------------------------------------------------------------ properties

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self._guard_inner.supports_divergent_local_hybrid_hits)

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self._guard_inner.requires_kv_delivery)

    # ------------------------------------------------------------ both roles

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._guard_inner.bind_connector_metadata(inner_metadata(connector_metadata))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._guard_inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._guard_inner.shutdown()

    def get_kv_connector_stats(self) -> GuardStats | None:
        return GuardStats.wrap(
            self._guard_inner.get_kv_connector_stats(),
            self._guard_inner_cls,
            self._guard_own_stats(),
        )

    def reset_cache(self) -> bool | None:
        if getattr(self, "role", None) != KVConnectorRole.SCHEDULER:
            return self._guard_inner.reset_cache()
        # Not reset (False) when the guard answers for it.
        return self._guard_scheduler_call("reset_cache", self._guard_inner.reset_cache, False)

    # ------------------------------------------------------------ worker role

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self._guard_inner.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._guard_inner.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._guard_inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self._guard_inner.finish_forward()

    def reset_capture_state(self) -> None:
        self._guard_inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._guard_inner.handle_preemptions(inner_metadata(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._guard_inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._guard_inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._guard_inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._guard_inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._guard_inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self._guard_inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._guard_inner.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._guard_inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._guard_inner.get_handshake_metadata()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._guard_inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._guard_inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._guard_inner.build_connector_worker_meta()

    def get_finished_count(self) -> int | None:
        return self._guard_inner.get_finished_count()

    # ------------------------------------------------------------ scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._guard_inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._guard_inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._guard_inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        inner = self._guard_inner
        return self._guard_scheduler_call(  # type: ignore[no-any-return]
            f"get_num_new_matched_tokens({request.request_id})",
            lambda: inner.get_num_new_matched_tokens(request, num_computed_tokens),
            (0, False),
        )

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> Any:
        return self._guard_inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._guard_inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._guard_inner.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self._guard_inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._guard_inner.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._guard_inner.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        inner = self._guard_inner
        if isinstance(inner, SupportsHMA):
            return inner.request_finished_all_groups(request, block_ids)
        if len(block_ids) != 1:
            raise ValueError(f"{type(inner).__name__} does not support several KV-cache groups")
        return inner.request_finished(request, block_ids[0])

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return bool(
            self._guard_inner.register_finished_partial_tail(
                request, block_ids, partial_tail_offloads
            )
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        return cast("Iterable[KVCacheEvent]", self._guard_inner.take_events())

    def has_pending_block_frees(self) -> bool:
        return bool(self._guard_inner.has_pending_block_frees())

    def has_pending_push_work(self) -> bool:
        return bool(self._guard_inner.has_pending_push_work())

    # ------------------------------------------------------------ class-level

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        from connectors.guard.connector import inner_class_and_config

        if vllm_config.kv_transfer_config is None:
            return None
        inner_cls, inner_config, _ = inner_class_and_config(vllm_config)
        return cast("str | None", inner_cls.get_required_kvcache_layout(inner_config))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from connectors.guard.config import parse_guard_config

        config = parse_guard_config(extra_config)
        module, sep, name = config.inner.rpartition(":")
        inner_cls = KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector=name, kv_connector_module_path=module if sep else None)
        )
        return bool(inner_cls.requires_piecewise_for_cudagraph(dict(config.inner_extra_config)))
