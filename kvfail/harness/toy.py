"""``ToyConnector``: a TEST DOUBLE at the transport boundary. It is not a real connector.

Why it exists: the harness (``kvfail.harness.engine``) must be tested against vLLM's real
``Scheduler`` with loads that complete, fail or hang exactly when a test says so. A real
transport cannot be commanded that precisely, so this class replaces only the transport:
its "network" is :data:`TRANSPORT`, an in-memory dict in this process. Everything around
it is vLLM's: the scheduler builds the SCHEDULER role from ``kv_connector_module_path``,
the harness builds the WORKER role with ``(vllm_config, KVConnectorRole.WORKER,
kv_cache_config)``, registers real CPU KV tensors and drives the real per-step call order.
Do not use it to conclude anything about NIXL, Mooncake or any shipped connector.

Behaviour
---------
* Scheduler side. A request whose ``kv_transfer_params`` has ``do_remote_prefill`` gets an
  async hit of ``len(prompt) - 1 - num_computed_tokens`` tokens rounded down to whole
  blocks, once per request (after a failure the next lookup misses, as C12 requires).
  ``extra_config["toy_readvertise"] = True`` makes it advertise on every lookup: the
  #55297 load-fail-reload loop, as a negative control.
* Producer side. A request with ``do_remote_decode`` keeps its blocks after it finishes
  (``request_finished`` returns True); the worker copies them into :data:`TRANSPORT` in
  ``wait_for_save`` and reports ``finished_sending``. The returned ``kv_transfer_params``
  are what a D request needs to load them.
* Worker side. Bookkeeping goes through :class:`kvfail.FailureReporterMixin` (track,
  succeed, fail, drain; the mixin routes failures to the block- or request-level channel
  by KV-cache group count). ``extra_config["toy_mode"]`` sets what a new load does:
  ``"complete"`` (default: succeeds in the step it starts, copying bytes from
  :data:`TRANSPORT` when the producer saved some), ``"hold"`` (waits for
  :meth:`ToyConnector.complete` / :meth:`ToyConnector.fail`) or ``"fail"``.
  ``extra_config["toy_deadline_s"]`` gives loads a watchdog deadline.
* :meth:`ToyConnector.inject` adds raw reports that bypass the reporter (an unknown id in
  ``finished_recving`` for C7, ``invalid_block_ids`` with two groups for C5): negative
  controls for the harness's crash recording.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvfail import FailureReporterMixin, Stage, compat
from kvfail.compat import KVConnectorTransferResults
from kvfail.deadline import seconds_from
from kvfail.vllm_quarantine import QuarantineConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["TRANSPORT", "ToyConnector", "ToyLoad", "ToyMetadata", "ToySave", "ToyTransport"]

Key = tuple[str, str]  # (producer engine id, producer request id)

#: In-process toy workers have no TP rank of their own (the harness simulates TP), so each
#: gets its own key for the quarantine's per-rank holds.
_WORKER_KEYS = itertools.count()


class ToyTransport:
    """The toy's whole "network": saved KV blocks per (engine id, request id), in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[Key, dict[str, torch.Tensor]] = {}

    def put(self, key: Key, layers: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._data[key] = layers

    def get(self, key: Key) -> dict[str, torch.Tensor] | None:
        with self._lock:
            return self._data.get(key)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


#: The process-wide in-memory transport shared by every toy producer and consumer.
TRANSPORT = ToyTransport()


@dataclass(frozen=True)
class ToyLoad:
    """One load the scheduler side asks the workers to perform."""

    block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV-cache group
    num_tokens: int
    key: Key | None  # where the producer saved the data; None: nothing to copy


@dataclass(frozen=True)
class ToySave:
    """One finished producer request whose blocks the workers copy out."""

    block_ids: tuple[tuple[int, ...], ...]
    key: Key


@dataclass
class ToyMetadata(KVConnectorMetadata):
    """Per-step metadata from the scheduler side to every worker."""

    loads: dict[str, ToyLoad] = field(default_factory=dict)
    saves: dict[str, ToySave] = field(default_factory=dict)


class _ToyConnectorCore(FailureReporterMixin, KVConnectorBase_V1, SupportsHMA):
    """Test double; see the module docstring. Both roles live in one class, as in vLLM."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.engine_id: str = str(self._kv_transfer_config.engine_id)
        self.block_size: int = vllm_config.cache_config.block_size
        self.readvertise: bool = bool(extra.get("toy_readvertise", False))
        self.mode: str = str(extra.get("toy_mode", "complete"))
        if self.mode not in ("complete", "hold", "fail"):
            raise ValueError(f"toy_mode must be complete, hold or fail, got {self.mode!r}")
        self.num_groups: int = len(kv_cache_config.kv_cache_groups)
        self._group_of: dict[str, int] = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        # Scheduler side.
        self._lookups: dict[str, int] = {}
        self._advertised: set[str] = set()
        self._pending_loads: dict[str, ToyLoad] = {}
        self._pending_saves: dict[str, ToySave] = {}
        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._inflight: dict[str, ToyLoad] = {}
        self._sent: set[str] = set()
        self._raw = KVConnectorTransferResults()
        self._raw_invalid: set[int] = set()
        #: Loads whose transport write is still on its way (:meth:`hold_write`).
        self._writes_pending: set[str] = set()
        #: Every load this worker ever started, in order (tests inspect it).
        self.started: list[str] = []
        #: The watchdog deadline of the worker's loads, declared for the conformance suite.
        self.kv_load_deadline_s = seconds_from(extra, "toy_deadline_s", None)
        if role == KVConnectorRole.WORKER:
            self.init_failure_reporter(
                num_kv_cache_groups=self.num_groups,
                name=f"toy[{self.engine_id}]",
                default_deadline_s=self.kv_load_deadline_s,
                quarantine=compat.block_pool_binding_available(),
                rank=next(_WORKER_KEYS),
            )

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id in self._advertised and not self.readvertise:
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        hit = (prompt_len - 1 - num_computed_tokens) // self.block_size * self.block_size
        if hit <= 0:
            return 0, False
        self._lookups[request.request_id] = num_computed_tokens
        return hit, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        self._advertised.add(req_id)
        first = self._lookups.pop(req_id, 0) // self.block_size
        count = num_external_tokens // self.block_size
        groups = tuple(tuple(ids[first : first + count]) for ids in blocks.get_block_ids())
        params = request.kv_transfer_params or {}
        engine = params.get("remote_engine_id")
        key = (str(engine), str(params.get("remote_request_id", req_id))) if engine else None
        self._pending_loads[req_id] = ToyLoad(groups, num_external_tokens, key)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ToyMetadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = {}, {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._lookups.pop(request.request_id, None)
        self._advertised.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or not any(block_ids):
            return False, None
        key = (self.engine_id, request.request_id)
        groups = tuple(tuple(ids) for ids in block_ids)
        self._pending_saves[request.request_id] = ToySave(groups, key)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": key[0],
            "remote_request_id": key[1],
            "remote_block_ids": [list(g) for g in groups],
            "remote_num_tokens": request.num_tokens,
        }

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ToyMetadata)
        for req_id, load in meta.loads.items():
            self.started.append(req_id)
            self._inflight[req_id] = load
            self.track_load(req_id, [list(g) for g in load.block_ids])
            if self.mode == "complete":
                self.complete(req_id)
            elif self.mode == "fail":
                self.fail(req_id, reason="toy: toy_mode=fail")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ToyMetadata)
        for req_id, save in meta.saves.items():
            layers = {
                name: cache[list(save.block_ids[self._group_of[name]])].clone()
                for name, cache in self.kv_caches.items()
            }
            TRANSPORT.put(save.key, layers)
            self._sent.add(req_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self.transfer_results(finished_sending=self._sent)
        self._sent = set()
        raw, self._raw = self._raw, KVConnectorTransferResults()
        results.finished_sending |= raw.finished_sending
        results.finished_recving |= raw.finished_recving
        results.failed_recving |= raw.failed_recving
        for req_id in results.finished_recving:
            self._inflight.pop(req_id, None)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid = FailureReporterMixin.get_block_ids_with_load_errors(self)
        raw, self._raw_invalid = self._raw_invalid, set()
        return invalid | raw

    def kvfail_fence(self, req_id: str) -> bool:
        """Nothing can write into the load's blocks unless the transport still has a
        write for it on its way (:meth:`hold_write`)."""
        return req_id not in self._writes_pending

    # ------------------------------------------------------------ test commands

    def hold_write(self, req_id: str) -> bool:
        """The transport has a write for this in-flight load on its way: until
        :meth:`land_write`, its blocks must not go back (a deadline failure is reported
        at once, the blocks quarantined)."""
        if req_id not in self._inflight:
            return False
        self._writes_pending.add(req_id)
        return True

    def land_write(self, req_id: str, load: ToyLoad) -> None:
        """The write held by :meth:`hold_write` lands: P's bytes go into ``load``'s
        blocks now (wherever the scheduler has them by then), and the load is fenced."""
        self._deliver(load)
        self._writes_pending.discard(req_id)
        if self.failure_reporter.is_quarantined(req_id):
            self.load_fenced(req_id)

    def inflight(self) -> set[str]:
        """Loads started on this worker and not yet reported."""
        return set(self._inflight)

    def complete(self, req_id: str) -> bool:
        """Finish a load: copy the producer's bytes if it saved any, then report success."""
        load = self._inflight.get(req_id)
        if load is None:
            return False
        self._deliver(load)
        return self.load_succeeded(req_id)

    def _deliver(self, load: ToyLoad, *, missing: int | None = None) -> None:
        """Copy the producer's bytes into the load's blocks, except block index ``missing``
        of every group (a transfer that lost one block delivered the others)."""
        data = TRANSPORT.get(load.key) if load.key else None
        if data is None:
            return
        for name, cache in self.kv_caches.items():
            src = data.get(name)
            dst = list(load.block_ids[self._group_of[name]])
            if src is None or not dst:
                continue
            keep = [i for i in range(min(len(dst), src.shape[0])) if i != missing]
            cache[[dst[i] for i in keep]] = src[keep]

    def fail(
        self,
        req_id: str,
        *,
        stage: Stage = Stage.TRANSFER,
        reason: str = "toy: commanded failure",
        block_index: int | None = None,
    ) -> bool:
        """Fail a load; ``block_index`` narrows it to one block (index into group 0): the
        other blocks arrived, so the scheduler may keep them as computed."""
        load = self._inflight.get(req_id)
        if load is None:
            return False
        narrowed = None
        if block_index is not None:
            self._deliver(load, missing=block_index)
            narrowed = [load.block_ids[0][block_index]]
        return self.load_failed(req_id, stage, reason, block_ids=narrowed)

    def inject(
        self,
        *,
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        finished_sending: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> None:
        """Raw reports for the next step, bypassing the reporter. Negative controls only."""
        self._raw.finished_recving.update(finished_recving)
        self._raw.failed_recving.update(failed_recving)
        self._raw.finished_sending.update(finished_sending)
        self._raw_invalid.update(invalid_block_ids)


class ToyConnector(QuarantineConnector, _ToyConnectorCore):
    """The toy with kvfail's quarantine in front, as the shipped connectors have it: a
    load failed while its write is pending is reported at once and its blocks held."""
