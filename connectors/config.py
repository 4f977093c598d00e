"""kvfail's own ``kv_connector_extra_config`` keys, validated once at start-up.

Why: the connectors used to read each ``kvfail_*`` key by hand where it was used, so a
misspelt key was silently ignored (a deadline that never applies strands requests) and a
bad value surfaced only when that code first ran. Here each connector declares the
``kvfail_*`` keys it reads as a pydantic model; an unknown or misspelt ``kvfail_*`` key,
a wrong type or an impossible value fails the connector's construction with one message
that names every offending key. Keys without the ``kvfail_`` prefix belong to upstream
and pass through untouched.

pydantic comes with vLLM; only ``connectors`` imports this module (``import kvfail``
stays free of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

__all__ = [
    "KVFAIL_PREFIX",
    "KvfailConfig",
    "MooncakeKvfailConfig",
    "NixlPullKvfailConfig",
    "NixlPushKvfailConfig",
    "validate_extra_config",
]

KVFAIL_PREFIX: Final = "kvfail_"

#: Seconds: a number >= 0 (not a bool, not a string); ``None`` or 0 mean off, as
#: :func:`kvfail.deadline.seconds_from` reads them.
Seconds = Annotated[StrictInt | StrictFloat, Field(ge=0, allow_inf_nan=False)]
#: A whole number of blocks >= 0.
Blocks = Annotated[StrictInt, Field(ge=0)]


class KvfailConfig(BaseModel):
    """Keys every kvfail connector reads. A subclass adds its connector's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: The connector's name in messages.
    CONNECTOR: ClassVar[str] = "kvfail connector"

    kvfail_deadline_s: Seconds | None = None
    kvfail_quarantine_max_blocks: Blocks | None = None


class NixlPullKvfailConfig(KvfailConfig):
    CONNECTOR: ClassVar[str] = "KvfailNixlConnector"
    kvfail_probe_interval_s: Seconds | None = None


class NixlPushKvfailConfig(KvfailConfig):
    CONNECTOR: ClassVar[str] = "KvfailNixlPushConnector"
    kvfail_max_hold_s: Seconds | None = None


class MooncakeKvfailConfig(KvfailConfig):
    CONNECTOR: ClassVar[str] = "KvfailMooncakeConnector"
    kvfail_probe_interval_s: Seconds | None = None
    kvfail_max_hold_s: Seconds | None = None
    kvfail_fence_grace_s: Seconds | None = None


def validate_extra_config(
    extra: Mapping[str, Any] | None, model: type[KvfailConfig]
) -> KvfailConfig:
    """Check the ``kvfail_*`` keys of ``extra`` against ``model``; raise ``ValueError``
    naming every bad key. Other keys are upstream's and are not looked at."""
    ours = {k: v for k, v in (extra or {}).items() if str(k).startswith(KVFAIL_PREFIX)}
    try:
        return model(**ours)
    except ValidationError as exc:
        known = ", ".join(sorted(model.model_fields))
        # One line per key: a value against a union (int or float) fails every branch.
        by_key: dict[str, list[dict[str, Any]]] = {}
        for error in exc.errors():
            by_key.setdefault(str(error["loc"][0]) if error["loc"] else "?", []).append(error)
        problems = []
        for key, errors in by_key.items():
            first = errors[0]
            if first["type"] == "extra_forbidden":
                problems.append(f"{key}: not a key {model.CONNECTOR} reads (known: {known})")
            else:
                msg = first["msg"] if len(errors) == 1 else "must be a number >= 0 or null"
                problems.append(f"{key}={first.get('input')!r}: {msg}")
        raise ValueError(
            f"{model.CONNECTOR}: bad kv_connector_extra_config: " + "; ".join(problems)
        ) from None
