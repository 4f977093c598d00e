"""Run vLLM's Scheduler as if block-level load-error reporting were removed.

Why: vLLM's RFC #35780 and its PR #42461 would drop per-block error reporting
(``get_block_ids_with_load_errors`` / ``KVConnectorOutput.invalid_block_ids``) in favour of
failed request ids and a full recompute. A connector that can only name blocks would then
have no way to fail a load; one that adapts to the vLLM it runs on (kvfail's mixin, through
:func:`kvfail.compat.routing`) must switch to request ids. This mode lets the suite judge
that today, on the installed vLLM.

The switch: ``KVFAIL_REPORTING=request-level`` in the environment (read by
:attr:`kvfail.harness.config.EngineSpec.reporting`'s default, so every engine of a run,
its rank processes and the rig's peer processes agree), or ``EngineSpec(reporting=...)``.
``block-level`` (the default) is the installed vLLM as it is.

What ``request-level`` changes, each as #42461 does, by adapting vLLM's own classes:

* the connector interface: ``KVConnectorBase_V1`` no longer declares
  ``get_block_ids_with_load_errors`` while an engine in this mode exists in the process, so
  :mod:`kvfail.compat` detects no block-level channel, as it would on such a vLLM;
* the model runner: it never asks a connector for block ids. During one rank's worker
  hooks the connector's ``get_block_ids_with_load_errors`` (its own, if it has one: dead
  code on such a vLLM) is shadowed by an answer of no blocks, so vLLM's runner mixin
  leaves ``invalid_block_ids`` empty;
* the scheduler (:class:`RequestLevelScheduler`): its block-level path is gone; a failed
  load reaches it only in ``failed_recving``, which the installed scheduler already
  recovers by a full recompute (no computed token kept) or fails, per policy. A block
  report reaching it anyway is a harness error (:class:`BlockLevelRemovedError`).

Needs a vLLM with the request-level channel (0.30+); elsewhere the mode raises
:class:`kvfail.compat.MissingFeatureError`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, get_args

from kvfail import compat

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

__all__ = [
    "ENV",
    "BlockLevelRemovedError",
    "Reporting",
    "block_level_removed",
    "from_env",
    "hold",
    "runner_view",
    "scheduler_class",
]

Reporting = Literal["block-level", "request-level"]
#: The environment variable that switches every engine of a run.
ENV = "KVFAIL_REPORTING"
#: What the block-level channel is called on the connector interface.
_METHOD = "get_block_ids_with_load_errors"


class BlockLevelRemovedError(RuntimeError):
    """Block ids reached a scheduler running as if block-level reporting were removed."""


def from_env() -> Reporting:
    """The mode the environment asks for (``block-level`` when unset)."""
    value = os.environ.get(ENV, "").strip() or "block-level"
    if value not in get_args(Reporting):
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(get_args(Reporting))}")
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------- interface

_lock = threading.Lock()
_holders = 0
_removed: dict[str, Any] = {}


def _base() -> type[KVConnectorBase_V1]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


def block_level_removed() -> bool:
    """Whether this process runs as if block-level reporting were removed."""
    return bool(_removed)


def hold(mode: Reporting) -> Callable[[], None]:
    """Put this process in ``mode`` for as long as the returned release is not called.

    An engine holds its mode for its life. Engines of one process must agree: connectors
    read the interface once, at construction, so a mixed process would judge some of
    them against the wrong vLLM. The base's method comes back when the last
    ``request-level`` holder releases.
    """
    global _holders
    if mode not in get_args(Reporting):
        raise ValueError(f"unknown reporting mode {mode!r}")
    with _lock:
        if mode == "block-level":
            if _removed:
                raise ValueError(
                    "a block-level engine in a process that runs as if block-level "
                    f"reporting were removed ({ENV}=request-level): one mode per process"
                )
            return lambda: None
        if not _removed:
            _require_request_channel()
            base = _base()
            _removed[_METHOD] = base.__dict__[_METHOD]
            delattr(base, _METHOD)
            compat.reset_detection()
        _holders += 1
    released = False

    def release() -> None:
        global _holders
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _holders -= 1
            if _holders == 0 and _removed:
                setattr(_base(), _METHOD, _removed.pop(_METHOD))
                compat.reset_detection()

    return release


def _require_request_channel() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    needed_by = f"{ENV}=request-level (the Scheduler without block-level reporting)"
    compat.require("request_level_channel", needed_by)
    compat.require("output_failed_recving", needed_by)
    if not hasattr(Scheduler, "_handle_failed_recving"):
        raise compat.MissingFeatureError(
            "request_level_channel",
            needed_by,
            "the scheduler has no recovery for failed_recving (_handle_failed_recving)",
        )
    if _METHOD not in _base().__dict__:
        raise compat.MissingFeatureError(
            "block_level_channel", needed_by, f"KVConnectorBase_V1 declares no {_METHOD}"
        )


# --------------------------------------------------------------------------- runner


def _no_block_ids() -> set[int]:
    return set()


@contextlib.contextmanager
def runner_view(connector: Any, mode: Reporting) -> Iterator[None]:
    """While one rank's worker hooks run: in ``request-level`` mode, the runner's call
    for block ids is answered by an empty set and never reaches the connector."""
    if mode == "block-level":
        yield
        return
    own = connector.__dict__.get(_METHOD)
    setattr(connector, _METHOD, _no_block_ids)
    try:
        yield
    finally:
        if own is None:
            delattr(connector, _METHOD)
        else:
            setattr(connector, _METHOD, own)


# --------------------------------------------------------------------------- scheduler


def _request_level_scheduler() -> type[Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    class RequestLevelScheduler(Scheduler):  # type: ignore[misc]
        """vLLM's Scheduler without its block-level path (vLLM PR #42461's interface)."""

        def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> set[str]:
            raise BlockLevelRemovedError(
                "block-level load-error reporting is removed in this mode: a failed load "
                "reaches the scheduler only as a failed request id (failed_recving)"
            )

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            output = getattr(model_runner_output, "kv_connector_output", None)
            if output is not None and output.invalid_block_ids:
                self._handle_invalid_blocks(output.invalid_block_ids)
            return super().update_from_output(scheduler_output, model_runner_output)

    return RequestLevelScheduler


_SCHEDULER: list[type[Any]] = []


def scheduler_class(mode: Reporting) -> type[Any]:
    """The Scheduler class an engine in ``mode`` builds."""
    if mode == "block-level":
        from vllm.v1.core.sched.scheduler import Scheduler

        return Scheduler
    if not _SCHEDULER:
        _SCHEDULER.append(_request_level_scheduler())
    return _SCHEDULER[0]


def __getattr__(name: str) -> Any:
    """``RequestLevelScheduler`` is built on first access: it subclasses vLLM's."""
    if name == "RequestLevelScheduler":
        return scheduler_class("request-level")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
