"""The worker side of one engine step, shared by in-process and per-process TP ranks.

Why one function: a rank that runs in this process (``tp_mode="simulated"``) and a rank
that runs in its own OS process (``tp_mode="processes"``, :mod:`kvfail.harness.ranks`)
must call the connector's worker hooks identically, or a scenario would test the harness
instead of the connector. The hooks themselves are vLLM's: ``handle_preemptions``, then
``KVConnectorModelRunnerMixin`` (``kv_connector_no_forward`` when nothing is scheduled,
else ``_get_kv_connector_output`` around the forward), as the GPU/CPU model runner does.

The forward is split the way a real engine splits it (:class:`SplitForward`): what only
the scheduler process knows (block ids, computed tokens) is turned into a small picklable
``plan`` there; ``apply`` runs on the rank, next to its KV tensors; ``collect`` takes the
rank's result back in the scheduler process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvfail.harness.reporting import Reporting, runner_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvfail.harness.config import BuiltConfig
    from kvfail.harness.engine import Engine

__all__ = [
    "ForwardHookError",
    "KVLayer",
    "LayerAttentionMetadata",
    "LayerContext",
    "RankView",
    "SplitForward",
    "StepResult",
    "run_worker_hooks",
]


@dataclass(frozen=True)
class LayerAttentionMetadata:
    """One layer's attention metadata for a harness step: the KV slots the step's
    scheduled tokens are written to, in batch order (what a layer-wise connector reads)."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int


@dataclass
class KVLayer:
    """An attention layer as the forward context holds it: ``kv_cache`` is the layer's
    ``[B, H, N, C]`` view, bound as vLLM's ``bind_kv_cache`` binds it."""

    kv_cache: torch.Tensor


@dataclass(frozen=True)
class LayerContext:
    """What the model runner puts in the forward context for one step (see
    ``EngineSpec.layer_forward_context``): metadata and a layer object per layer name."""

    attn_metadata: dict[str, LayerAttentionMetadata]
    layers: dict[str, KVLayer]


@dataclass(frozen=True)
class RankView:
    """What code running *on* a rank may touch: its connector, its tensors, its config."""

    rank: int
    world_size: int
    connector: KVConnectorBase_V1
    kv_caches: dict[str, torch.Tensor]
    built: BuiltConfig

    def layer_group(self, layer: int) -> int:
        """The KV-cache group of layer ``layer`` (``build_kv_cache_config``'s rule)."""
        return layer % self.built.spec.num_kv_cache_groups


@dataclass(frozen=True)
class SplitForward:
    """A forward hook that works wherever the rank runs.

    ``plan(engine, so)`` runs in the scheduler process once per step with tokens to
    compute, and returns a picklable payload (or None to skip the step). ``apply(view,
    payload)`` runs on every rank inside the connector's forward window and must be a
    module-level function (it is pickled by reference). ``collect(engine, rank,
    result)``, optional, receives each rank's return value in the scheduler process.
    """

    plan: Callable[[Engine, SchedulerOutput], Any]
    apply: Callable[[RankView, Any], Any]
    collect: Callable[[Engine, int, Any], None] | None = None


class ForwardHookError(Exception):
    """The forward hook raised (a harness/peer bug, reported as phase ``forward[rank]``)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


@dataclass
class StepResult:
    """One rank's step: the runner's output when nothing was computed (``no_forward``),
    else the connector output to put in a ModelRunnerOutput, plus the forward's result."""

    no_forward: ModelRunnerOutput | None
    kv_output: KVConnectorOutput | None
    forward_result: Any = None


def run_worker_hooks(
    connector: KVConnectorBase_V1,
    so: SchedulerOutput,
    vllm_config: VllmConfig,
    forward: Callable[[], Any] | None,
    layers: LayerContext | None = None,
    reporting: Reporting = "block-level",
) -> StepResult:
    """Run one rank's connector hooks for ``so``; ``forward`` is called where the model
    would run (inside the connector's load/save window). Raises :class:`ForwardHookError`
    if ``forward`` raises, and whatever a connector hook raises.

    With ``layers``, the forward context carries their attention metadata and layer
    objects, and each layer's ``wait_for_layer_load`` (before the forward) and
    ``save_kv_layer`` (after it) are called, as vLLM's attention layers call them.

    ``reporting="request-level"``: the runner never asks the connector for block ids
    (:func:`kvfail.harness.reporting.runner_view`)."""
    with runner_view(connector, reporting):
        return _run_worker_hooks(connector, so, vllm_config, forward, layers)


def _run_worker_hooks(
    connector: KVConnectorBase_V1,
    so: SchedulerOutput,
    vllm_config: VllmConfig,
    forward: Callable[[], Any] | None,
    layers: LayerContext | None,
) -> StepResult:
    assert so.kv_connector_metadata is not None
    connector.handle_preemptions(so.kv_connector_metadata)
    if so.total_num_scheduled_tokens == 0:
        # What the runner does with nothing to compute: connector work only.
        mro = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, vllm_config)
        # The empty case returns a shared module-level object: never mutate it.
        return StepResult(copy.copy(mro), None)
    result: Any = None
    static = vllm_config.compilation_config.static_forward_context
    saved = dict(static)
    if layers is not None:  # what the model's construction registers, here per step
        static.update(layers.layers)
    try:
        with (
            set_forward_context(None if layers is None else layers.attn_metadata, vllm_config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_output,
        ):
            for name in layers.layers if layers is not None else ():
                connector.wait_for_layer_load(name)
            if forward is not None:
                try:
                    result = forward()
                except Exception as exc:
                    raise ForwardHookError(exc) from exc
            if layers is not None:
                for name, layer in layers.layers.items():
                    connector.save_kv_layer(name, layer.kv_cache, layers.attn_metadata[name])
    finally:
        static.clear()
        static.update(saved)
    return StepResult(None, kv_output, result)
