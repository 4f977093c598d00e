"""The guard's configuration: its ``kv_connector_extra_config``, as a pydantic model.

Why pydantic: vLLM's own configs are pydantic, and a guard misconfigured in silence is
worse than none (a misspelt ``deadline_s`` would leave loads with no deadline at all). So
a wrong type, an impossible value or an unknown key stops start-up, with one message that
names every offending key. This module is under ``connectors/``, never imported by
``import kvfail``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_LOOKUP_DEADLINE_S",
    "GuardConfig",
    "GuardConfigError",
    "lookup_deadline_s",
    "parse_guard_config",
]

#: A load's deadline when none is configured: long enough for a cold first transfer on a
#: loaded host, short enough that a request stuck on a dead P gets its answer.
DEFAULT_DEADLINE_S = 30.0
#: The most a lookup waits when ``lookup_deadline_s`` is not set (and ``deadline_s`` is
#: longer): a lookup holds the scheduler's one thread, so every request of the engine
#: waits with it, where a load holds only its own request.
DEFAULT_LOOKUP_DEADLINE_S = 5.0


class GuardConfigError(ValueError):
    """The guard's ``kv_connector_extra_config`` is wrong; the message names each key."""


class GuardConfig(BaseModel):
    """``kv_connector_extra_config`` of ``KvfailGuardConnector``."""

    # strict: "30" is not 30 and True is not 1; forbid: a misspelt key is an error.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    #: The connector to guard: a vLLM registry name (``MooncakeConnector``) or
    #: ``module:Class``.
    inner: str = Field(min_length=1)
    #: The inner connector's own ``kv_connector_extra_config``, passed through untouched.
    inner_extra_config: dict[str, Any] = Field(default_factory=dict)
    #: Seconds from the start of a load (the worker's ``start_load_kv`` for it) to its
    #: failure when the inner connector has not reported it.
    deadline_s: float = Field(default=DEFAULT_DEADLINE_S, gt=0)
    #: Seconds a scheduler-side call into the inner that may wait on a remote (its
    #: ``get_num_new_matched_tokens``, and ``reset_cache``) may take before the guard
    #: answers without it ("nothing to load"); None: ``deadline_s``, at most
    #: :data:`DEFAULT_LOOKUP_DEADLINE_S`.
    lookup_deadline_s: float | None = Field(default=None, gt=0)
    #: Most KV blocks held in quarantine before new remote loads are computed locally;
    #: None: a quarter of the KV cache (as kvfail's connectors).
    quarantine_max_blocks: int | None = Field(default=None, ge=0)
    #: How often a quarantined load's P is probed again for proof that it is gone.
    fence_retry_s: float = Field(default=1.0, ge=0)
    #: How long one probe of a P's advertised address may take (it runs in the drain).
    probe_timeout_s: float = Field(default=0.2, gt=0, le=5)


def lookup_deadline_s(config: GuardConfig) -> float:
    """The lookup deadline in force (see :attr:`GuardConfig.lookup_deadline_s`)."""
    if config.lookup_deadline_s is not None:
        return config.lookup_deadline_s
    return min(config.deadline_s, DEFAULT_LOOKUP_DEADLINE_S)


def parse_guard_config(extra: Mapping[str, Any] | None) -> GuardConfig:
    """Validate ``extra``; raises :class:`GuardConfigError` naming every bad key."""
    try:
        return GuardConfig.model_validate(dict(extra or {}))
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"]) or "(config)"
            shown = "" if error["type"] == "missing" else f" (got {error['input']!r})"
            problems.append(f"{key!r}: {error['msg']}{shown}")
        raise GuardConfigError(
            "KvfailGuardConnector: invalid kv_connector_extra_config: " + "; ".join(problems)
        ) from None
