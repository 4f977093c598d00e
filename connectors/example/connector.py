"""``KvfailExampleConnector``: upstream's ExampleConnector with kvfail's failure reporting.

Load it into vLLM with::

    KVTransferConfig(kv_connector="KvfailExampleConnector",
                     kv_connector_module_path="connectors.example",
                     kv_connector_extra_config={"shared_storage_path": "/some/dir"}, ...)

Upstream's scheduler half is kept as it is (lookup by prompt hash, one safetensors file
per layer). What changes is what the worker trusts:

* save: beside every file it writes, a digest of the file's bytes (``<file>.sha256``,
  written to a temporary name and renamed, so a reader never sees half a digest);
* load: each layer's file is read once, its bytes checked against that digest, parsed,
  and its shape checked against the slots it is meant for, before anything is written
  into the KV cache. Anything that goes wrong (file gone, cut short, garbage, a
  directory, bytes that are not the ones saved, no digest, no attention metadata) is one
  :meth:`load_failed` call naming every block of that load, never an exception out of
  ``start_load_kv``.

Loads are synchronous (``get_num_new_matched_tokens`` answers ``(n, False)``), so a failure
reaches the scheduler through ``get_block_ids_with_load_errors`` in the same step, and
nothing is ever put in ``finished_recving``: the request never waited for remote KV.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

from kvfail.compat import KVConnectorTransferResults, make_transfer_results
from kvfail.reporter import FailureReporterMixin
from kvfail.stages import Stage

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["DIGEST_SUFFIX", "KvfailExampleConnector", "KvfailExampleMetadata", "StoreError"]

#: The digest of ``<layer>.safetensors`` lives in ``<layer>.safetensors.sha256``.
DIGEST_SUFFIX = ".sha256"
#: The one tensor upstream stores in each file.
TENSOR_KEY = "kv_cache"


class StoreError(Exception):
    """A stored layer that must not be loaded; the message says why, for the report."""


@dataclass
class KvfailExampleMetadata(ExampleConnectorMetadata):
    """Upstream's metadata plus the request id of each load, in the order of its load
    entries (upstream's entries carry no id, and the reports should name the request)."""

    load_ids: list[str] = field(default_factory=list)


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def write_digest(path: Path) -> None:
    """Record the digest of ``path`` as it is now; atomic for readers."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    target = digest_path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n")
    tmp.replace(target)


def read_verified(path: Path) -> torch.Tensor:
    """The stored tensor of ``path``, only if its bytes are the ones its digest names."""
    from safetensors.torch import load as parse

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{path.name}: file is gone") from None
    except IsADirectoryError:
        raise StoreError(f"{path.name}: is a directory, not a file") from None
    except OSError as exc:
        raise StoreError(f"{path.name}: unreadable ({exc.strerror or exc})") from None
    try:
        expected = digest_path(path).read_text().strip()
    except OSError:
        raise StoreError(f"{path.name}: no digest beside it; its bytes cannot be trusted") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise StoreError(
            f"{path.name}: digest mismatch ({len(data)} bytes, sha256 {actual[:12]}, "
            f"saved {expected[:12]}): overwritten or damaged since it was saved"
        )
    try:
        tensors = parse(data)
    except Exception as exc:  # safetensors raises its own error types
        raise StoreError(f"{path.name}: not a safetensors file ({exc})") from None
    if TENSOR_KEY not in tensors:
        raise StoreError(f"{path.name}: no {TENSOR_KEY!r} tensor in it")
    return tensors[TENSOR_KEY]


def load_blocks(load: ReqMeta, block_size: int) -> list[int]:
    """The blocks one load writes into, in order (upstream's metadata keeps slots only)."""
    seen: dict[int, None] = {}
    for slot in load.slot_mapping.tolist():
        seen.setdefault(int(slot) // block_size, None)
    return list(seen)


class KvfailExampleConnector(FailureReporterMixin, ExampleConnector):
    """Upstream's ExampleConnector; see the module docstring for what differs."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if role == KVConnectorRole.WORKER:
            # Upstream loads and saves the first KV-cache group only (block_ids[0]), and
            # vLLM gives a connector without HMA support one group: blocks are unique.
            self.init_failure_reporter(num_kv_cache_groups=1, name=type(self).__name__)

    # ------------------------------------------------------------ scheduler side

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvfailExampleMetadata:
        """Upstream's metadata, with the id of each load, found the way upstream picks
        its loads: new requests it owes a load (in scheduling order), then resumed ones."""
        owed = set(self._requests_need_load)
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs if r.req_id in owed]
        cached = scheduler_output.scheduled_cached_reqs
        ids += [r for r in cached.req_ids if r in owed and r in cached.resumed_req_ids]
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleConnectorMetadata)
        return KvfailExampleMetadata(requests=meta.requests, load_ids=ids)

    # ------------------------------------------------------------ worker side

    def _loads(self) -> Iterator[tuple[str, ReqMeta]]:
        meta = self._get_connector_metadata()
        loads = [r for r in getattr(meta, "requests", ()) if not r.is_store]
        ids = list(getattr(meta, "load_ids", ()))
        if len(ids) != len(loads):  # metadata from elsewhere: ids that are still unique
            ids = [f"example-load-{id(meta):x}-{i}" for i in range(len(loads))]
        yield from zip(ids, loads, strict=True)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load every layer of every load, each load tracked and settled exactly once."""
        attn_metadata = getattr(forward_context, "attn_metadata", None)
        found = getattr(forward_context, "no_compile_layers", None) or {}
        layers = {
            name: kv
            for name, layer in found.items()
            if (kv := getattr(layer, "kv_cache", None)) is not None
        }
        for req_id, load in self._loads():
            blocks = load_blocks(load, self._block_size)
            if not self.track_load(req_id, blocks):
                continue
            try:
                self._load_one(load, layers, attn_metadata)
            except StoreError as exc:
                self.load_failed(req_id, Stage.TRANSFER, str(exc))
            except Exception as exc:  # never out of start_load_kv: the worker would die
                self.load_failed(req_id, Stage.INTERNAL, f"{type(exc).__name__}: {exc}")
            else:
                self.load_succeeded(req_id)

    def _load_one(self, load: ReqMeta, layers: dict[str, torch.Tensor], attn: Any) -> None:
        if not isinstance(attn, dict):
            # Upstream returns (None) or reads without writing (not a dict): either way
            # the request would run on KV nobody loaded.
            raise StoreError(f"no per-layer attention metadata ({type(attn).__name__})")
        if not layers:
            raise StoreError("no layer in the forward context exposes a KV cache")
        num_tokens = len(load.slot_mapping)
        # Every layer is read and checked before any is written: a bad layer costs the
        # load, never a half-written cache that looks loaded.
        staged: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        for name, dst in layers.items():
            if name not in attn:
                raise StoreError(f"{name}: no attention metadata for this layer")
            path = Path(self._generate_filename_debug(name, load.token_ids, load.mm_hashes))
            src = self._read_layer(path)
            latent = isinstance(attn[name], MLACommonMetadata)
            # [blocks, heads, block_size, head_dim]: a token is (heads, head_dim); MLA
            # keeps one latent row per slot.
            need = (num_tokens, dst.shape[-1]) if latent else (num_tokens, *dst.shape[1::2])
            if tuple(src.shape) != tuple(need) or src.dtype != dst.dtype:
                raise StoreError(
                    f"{path.name}: holds {src.dtype} {tuple(src.shape)}, the load needs "
                    f"{dst.dtype} {tuple(need)}"
                )
            staged.append((dst, src, latent))
        for dst, src, latent in staged:
            self._write(dst, src, load.slot_mapping, latent)

    def _read_layer(self, path: Path) -> torch.Tensor:
        """One stored layer, verified (:func:`read_verified`)."""
        return read_verified(path)

    def _write(
        self, dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor, latent: bool
    ) -> None:
        slots = slots.to(dst.device)
        src = src.to(dst.device)
        if latent:  # a view, so the write lands in the cache itself
            dst.view(-1, dst.shape[-1])[slots] = src
        else:
            dst[slots // self._block_size, :, slots % self._block_size] = src

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Upstream's save, then the digest of each file it wrote."""
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        meta = self._get_connector_metadata()
        for request in getattr(meta, "requests", ()):
            if request.is_store:
                path = self._generate_filename_debug(
                    layer_name, request.token_ids, request.mm_hashes
                )
                write_digest(Path(path))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Drain the step's settled loads. Every load is synchronous, so none belongs
        in ``finished_recving``; failed ones leave through the block channel."""
        self.drain_step()
        return make_transfer_results((), set(), set())
