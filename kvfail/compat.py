"""Feature detection of the installed vLLM, done lazily so ``import kvfail`` stays cheap.

This module is the only place in kvfail that knows how vLLM releases differ. It detects
features, never version strings, so backports and forks are judged by what they offer:

* the request-level channel: ``KVConnectorBase_V1.get_transfer_results`` returning a
  ``KVConnectorTransferResults`` with ``failed_recving`` (vLLM 0.30.0 and later). Older
  releases poll ``get_finished(finished_req_ids) -> (sending, recving)`` and know failed
  loads only by block (``get_block_ids_with_load_errors``);
* ``KVConnectorOutput.failed_recving``, the field that carries the request-level channel
  from the workers to the scheduler (arrived with it);
* the block-level channel: ``KVConnectorBase_V1.get_block_ids_with_load_errors`` feeding
  ``KVConnectorOutput.invalid_block_ids``. Every release so far has it; vLLM's RFC #35780
  (PR #42461) would remove it in favour of failed request ids and a full recompute, and
  the harness can already run the Scheduler that way (:mod:`kvfail.harness.reporting`);
* whether the scheduler refuses block ids on a layout with several KV-cache groups
  (vLLM #56855 raises ``RuntimeError`` there; older releases unpack one group and crash);
* the block-pool binding the quarantine needs: ``bind_kv_cache_manager`` (the manager,
  hence each request's blocks) where it exists, else ``bind_gpu_block_pool`` (the pool
  alone: :mod:`kvfail.vllm_quarantine` then records a load's blocks itself).

Which channel a failed load takes is decided once per layout by :func:`routing` (the
only place that weighs these features), then per load by the tracker from that answer.

Code that must run on every release imports :data:`KVConnectorTransferResults` from here:
vLLM's class where it exists, otherwise :class:`LegacyTransferResults` (same fields), which
:meth:`kvfail.FailureReporterMixin.get_finished` turns into the older tuple.

Where kvfail itself (the harness, a driver, one of kvfail's connectors) cannot work on the
installed vLLM, it raises :class:`MissingFeatureError` naming the feature: an API gap is
the tool's error, never a connector's verdict, never a skip.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_OUTPUTS = "vllm.v1.outputs"
_SCHEDULER = "vllm.v1.core.sched.scheduler"

#: Names of the features :func:`features` reports, with what each is.
FEATURES: dict[str, str] = {
    "request_level_channel": "KVConnectorBase_V1.get_transfer_results / "
    "KVConnectorTransferResults.failed_recving",
    "output_failed_recving": "KVConnectorOutput.failed_recving",
    "block_pool_binding": "KVConnectorBase_V1.bind_kv_cache_manager or bind_gpu_block_pool",
    "kv_cache_manager_binding": "KVConnectorBase_V1.bind_kv_cache_manager",
    "get_finished": "KVConnectorBase_V1.get_finished (the pre-0.30 completion poll)",
    "nixl_failed_set": "the NIXL worker's failed-request set (_recv_failures)",
    "block_level_channel": "KVConnectorBase_V1.get_block_ids_with_load_errors / "
    "KVConnectorOutput.invalid_block_ids",
    "multi_group_blocks_refused": "the scheduler's refusal of block ids with several "
    "KV-cache groups (vLLM #56855)",
}


class UnsupportedLayoutError(RuntimeError):
    """Raised at construction when failures in this KV layout could not be reported."""


class NoFailureChannelError(RuntimeError):
    """A failed load that the installed vLLM offers no channel for.

    Raised from the worker's completion poll instead of delivering the load as finished:
    on a vLLM without ``failed_recving`` (before 0.30), a load whose block ids were all
    unusable can be failed neither by id nor by block, and delivering it as finished
    would let the scheduler run the request on KV that never arrived. See
    :meth:`kvfail.FailureReporterMixin.drain_step` for why the engine step fails instead.
    """

    def __init__(self, req_ids: AbstractSet[str], needed_by: str) -> None:
        self.req_ids = frozenset(req_ids)
        self.feature = "request_level_channel"
        super().__init__(
            f"{needed_by}: load(s) {sorted(self.req_ids)} failed with no block id to name, "
            f"and reporting a failure by request id needs {FEATURES[self.feature]} "
            f"({self.feature}), {MISSING_FEATURE_MARK} (vLLM < 0.30). Refusing to deliver "
            "them as finished: the scheduler would run them on KV that never arrived."
        )


#: In every :class:`MissingFeatureError` message: how a report (the suite's, the audit's)
#: tells a run the tool could not judge from a connector's verdict.
MISSING_FEATURE_MARK = "which the installed vLLM lacks"


class MissingFeatureError(RuntimeError):
    """kvfail needs a vLLM feature the installed vLLM lacks.

    Raised by kvfail's own code (harness, drivers, kvfail's connectors), so a run on an
    older vLLM ends in an error that names what is missing instead of a verdict about the
    connector under test.
    """

    def __init__(self, feature: str, needed_by: str, detail: str = "") -> None:
        what = FEATURES.get(feature, feature)
        msg = f"{needed_by} needs {what} ({feature}), {MISSING_FEATURE_MARK}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.feature = feature
        self.needed_by = needed_by


def _module(name: str) -> Any:
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        return None


def _base_class() -> Any:
    module = _module(_BASE)
    return getattr(module, "KVConnectorBase_V1", None) if module is not None else None


@functools.cache
def transfer_results_class() -> type[Any] | None:
    """vLLM's ``KVConnectorTransferResults``, or None when vLLM lacks it (or is absent)."""
    module = _module(_BASE)
    if module is None:
        return None
    base = getattr(module, "KVConnectorBase_V1", None)
    if base is None or not hasattr(base, "get_transfer_results"):
        return None
    cls = getattr(module, "KVConnectorTransferResults", None)
    fields = getattr(cls, "__dataclass_fields__", {})
    # A results class without failed_recving would silently drop failures.
    return cls if "failed_recving" in fields else None


def request_level_channel_available() -> bool:
    """Whether a connector can fail a request by id (``failed_recving``)."""
    return transfer_results_class() is not None


@functools.cache
def output_has_failed_recving() -> bool:
    """Whether ``KVConnectorOutput`` carries ``failed_recving`` to the scheduler."""
    module = _module(_OUTPUTS)
    cls = getattr(module, "KVConnectorOutput", None) if module is not None else None
    return "failed_recving" in getattr(cls, "__dataclass_fields__", {})


@functools.cache
def kv_cache_manager_binding_available() -> bool:
    """Whether vLLM hands the connector its ``KVCacheManager`` (``bind_kv_cache_manager``),
    from which the quarantine reads a request's blocks."""
    return hasattr(_base_class(), "bind_kv_cache_manager")


@functools.cache
def block_pool_binding_available() -> bool:
    """Whether vLLM hands the connector its block pool, through the manager or alone
    (``bind_gpu_block_pool``): what :mod:`kvfail.quarantine` needs to hold a failed load's
    blocks. Without it a load that may still be written is held back until fenced, as
    before quarantine."""
    return kv_cache_manager_binding_available() or hasattr(_base_class(), "bind_gpu_block_pool")


@functools.cache
def get_finished_polled() -> bool:
    """Whether the installed vLLM's runner polls ``get_finished`` (no request channel):
    then a connector's ``get_transfer_results`` is only reached through the mixin's
    ``get_finished``."""
    return not request_level_channel_available() and hasattr(_base_class(), "get_finished")


@functools.cache
def nixl_failed_set_available() -> bool:
    """Whether upstream's NIXL worker keeps ``_recv_failures``, the set that makes it skip
    post-processing a failed load. kvfail's NIXL connector fills it (and cannot be built
    where it is missing). An instance attribute, so it is read from the module's source."""
    module = _module(_NIXL_WORKER)
    if module is None:
        return False
    try:
        return "self._recv_failures" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


@functools.cache
def block_level_channel_available() -> bool:
    """Whether a connector can fail a load by block: the base still declares
    ``get_block_ids_with_load_errors`` (what the model runner calls) and
    ``KVConnectorOutput`` still carries ``invalid_block_ids``. Both are gone in vLLM's
    PR #42461; the harness's request-level mode removes the first."""
    module = _module(_OUTPUTS)
    output = getattr(module, "KVConnectorOutput", None) if module is not None else None
    return hasattr(_base_class(), "get_block_ids_with_load_errors") and (
        "invalid_block_ids" in getattr(output, "__dataclass_fields__", {})
    )


@functools.cache
def multi_group_blocks_refused() -> bool:
    """Whether the installed scheduler refuses block ids on a layout with several
    KV-cache groups with its own error (vLLM #56855). Read from its source: the check is
    inside a method, not an attribute. False says only that the refusal is not explicit;
    such a scheduler unpacks one group and crashes instead (see :func:`routing`)."""
    module = _module(_SCHEDULER)
    handler = getattr(getattr(module, "Scheduler", None), "_handle_invalid_blocks", None)
    if handler is None:
        return False
    try:
        source = inspect.getsource(handler)
    except (OSError, TypeError):
        return False
    return "kv_cache_groups" in source and "raise" in source


@dataclass(frozen=True)
class Routing:
    """How failed loads of one KV layout reach the installed vLLM's scheduler."""

    #: ``failed_recving`` reaches the scheduler: a load can be failed by request id.
    request_level: bool
    #: Block ids may be reported for this layout (``get_block_ids_with_load_errors``).
    block_level: bool
    #: Why block level is not used here; empty when it is.
    why_not_blocks: str = ""

    @property
    def reportable(self) -> bool:
        """Some channel can carry a failure of a load with blocks."""
        return self.request_level or self.block_level


def routing(num_kv_cache_groups: int) -> Routing:
    """The one decision of which channels a connector on this vLLM may fail loads
    through, for a layout with ``num_kv_cache_groups`` groups.

    Block level is used only where it exists and the layout has one group. With several
    groups a flat set of block ids cannot be attributed to requests: a scheduler with
    vLLM #56855 raises (killing the engine), an older one unpacks a single group and
    crashes. Everything else goes by request id, which needs ``failed_recving``.
    """
    request = request_level_channel_available()
    if not block_level_channel_available():
        why = (
            "the installed vLLM has no block-level channel (get_block_ids_with_load_errors "
            "/ invalid_block_ids; removed by vLLM PR #42461)"
        )
        return Routing(request, False, why)
    if num_kv_cache_groups > 1:
        if multi_group_blocks_refused():
            why = "the scheduler refuses block ids with several KV-cache groups (vLLM #56855)"
        else:
            why = (
                "block ids are not unique across KV-cache groups, and this scheduler "
                "unpacks a single group (it would crash)"
            )
        return Routing(request, False, why)
    return Routing(request, True)


def reset_detection() -> None:
    """Forget every cached detection, for code that changes what vLLM offers in this
    process (the harness's request-level mode, tests that fake vLLM's modules)."""
    for fn in _CACHED:
        fn.cache_clear()


def base_method(name: str) -> Any:
    """``KVConnectorBase_V1``'s own ``name`` (its default), or None where the base has no
    such method. A test double that sets a hook back to the base's default overrides
    nothing by introspection on every release, including one without that hook."""
    return getattr(_base_class(), "__dict__", {}).get(name)


def features() -> dict[str, bool]:
    """Every feature kvfail distinguishes, detected from the installed vLLM."""
    return {
        "request_level_channel": request_level_channel_available(),
        "output_failed_recving": output_has_failed_recving(),
        "block_pool_binding": block_pool_binding_available(),
        "kv_cache_manager_binding": kv_cache_manager_binding_available(),
        "get_finished": hasattr(_base_class(), "get_finished"),
        "nixl_failed_set": nixl_failed_set_available(),
        "block_level_channel": block_level_channel_available(),
        "multi_group_blocks_refused": multi_group_blocks_refused(),
    }


def require(feature: str, needed_by: str, detail: str = "") -> None:
    """Raise :class:`MissingFeatureError` unless ``feature`` (a :data:`FEATURES` key) is
    present; for code of kvfail's that cannot run without it."""
    if feature not in FEATURES:
        raise KeyError(f"unknown vLLM feature {feature!r}; known: {sorted(FEATURES)}")
    if not features()[feature]:
        raise MissingFeatureError(feature, needed_by, detail)


@dataclass
class LegacyTransferResults:
    """``KVConnectorTransferResults`` for a vLLM that has none: the same three fields, so
    a connector builds its step's results one way on every release. ``failed_recving``
    never reaches such a vLLM (the mixin routes failures by block there)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def transfer_results_type() -> type[Any]:
    """The results class to build: vLLM's where it exists, else the legacy stand-in."""
    return transfer_results_class() or LegacyTransferResults


def make_transfer_results(
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
) -> Any:
    """One step's results in the installed vLLM's class (see :func:`transfer_results_type`)."""
    return transfer_results_type()(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving),
        failed_recving=set(failed_recving),
    )


def finished_pair(results: Any) -> tuple[set[str] | None, set[str] | None]:
    """The older ``get_finished`` shape of a results object: ``(sending, recving)``, each
    None when empty, as upstream's connectors return it. Failed loads stay in ``recving``
    (they finished); their blocks go out through ``get_block_ids_with_load_errors``.

    That shape has no place for a failed request id, so ids in ``failed_recving`` raise
    :class:`NoFailureChannelError` rather than go out as plain completions (the tracker
    never puts one there on such a vLLM; a connector's own report could)."""
    failed = set(getattr(results, "failed_recving", None) or ())
    if failed:
        raise NoFailureChannelError(failed, "get_finished")
    sending = set(results.finished_sending or ())
    recving = set(results.finished_recving or ())
    return sending or None, recving or None


def results_from_finished(finished: Any) -> Any:
    """A results object from either shape a worker may return: a results object (0.30+)
    or a ``(sending, recving)`` tuple (older ``get_finished``)."""
    if isinstance(finished, tuple):
        sending, recving = finished
        return make_transfer_results(sending or (), recving or ())
    return finished


def output_failed_recving(output: Any) -> frozenset[str]:
    """``output.failed_recving`` of a ``KVConnectorOutput``, empty on a vLLM whose output
    has no such field (nothing can be reported by id there, so nothing was)."""
    return frozenset(getattr(output, "failed_recving", None) or ())


_CACHED = (
    transfer_results_class,
    output_has_failed_recving,
    kv_cache_manager_binding_available,
    block_pool_binding_available,
    get_finished_polled,
    nixl_failed_set_available,
    block_level_channel_available,
    multi_group_blocks_refused,
)


def __getattr__(name: str) -> Any:
    """``from kvfail.compat import KVConnectorTransferResults`` resolves lazily (PEP 562):
    vLLM's class where it exists, else :class:`LegacyTransferResults`; importing this
    module still loads no vLLM."""
    if name == "KVConnectorTransferResults":
        return transfer_results_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
