"""A connector's load deadline: read from its configuration, declared on its instance.

Why here: the scheduler has no timeout, so a connector's own deadline is what ends a load
from a silent peer. The conformance suite must know that deadline to judge a report as
late, and must learn it from the connector itself, never from a table of class names. So
a connector *declares* it: an attribute :data:`DECLARED_ATTR` on its instance (seconds,
or ``None`` for "no deadline"). kvfail's connectors set it from the same configuration
value their tracker uses; a connector that declares nothing is judged against the
suite's own bounded wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "DEADLINE_KEY",
    "DECLARED_ATTR",
    "PROBE_INTERVAL_KEY",
    "UNDECLARED",
    "declared_deadline_s",
    "seconds_from",
]

#: ``kv_connector_extra_config`` key for kvfail's connectors' load deadline, in seconds.
DEADLINE_KEY: Final = "kvfail_deadline_s"
#: ``kv_connector_extra_config`` key for how often kvfail's connectors probe a P that loads
#: wait on for its death, in seconds (read with :func:`seconds_from`; off: null or 0).
PROBE_INTERVAL_KEY: Final = "kvfail_probe_interval_s"
#: The instance attribute a connector declares its load deadline with.
DECLARED_ATTR: Final = "kv_load_deadline_s"


class _Undeclared:
    def __repr__(self) -> str:
        return "UNDECLARED"


#: What :func:`declared_deadline_s` returns for a connector that declares nothing.
UNDECLARED: Final = _Undeclared()


def seconds_from(extra: Mapping[str, Any] | None, key: str, default: float | None) -> float | None:
    """A non-negative number of seconds from an extra config; ``None`` and ``0`` mean off.

    A value that is not a number of seconds is a configuration error, raised at once
    rather than turning into "no deadline" (which would strand requests silently).
    """
    value = default if extra is None else extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be seconds >= 0, got {value!r}")
    return float(value) or None


def declared_deadline_s(connector: object) -> float | _Undeclared | None:
    """The deadline ``connector`` declares (seconds, or None for none), else UNDECLARED."""
    value = getattr(connector, DECLARED_ATTR, UNDECLARED)
    if value is UNDECLARED or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"{type(connector).__name__}.{DECLARED_ATTR} must be seconds > 0 or None, got {value!r}"
        )
    return float(value)
