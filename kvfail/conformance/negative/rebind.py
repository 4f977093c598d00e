"""Breaking one method of a connector's built worker, for the real-connector controls.

Why re-class the built worker: a connector builds its worker itself, and building a
second one would start a second transfer engine; giving the built object a subclass of
its own class copies nothing and leaves every other method real.
"""

from __future__ import annotations

from typing import Any

__all__ = ["break_worker"]


def break_worker(connector: Any, broken: type) -> None:
    """Put ``broken``'s methods in front of the class of ``connector``'s worker (a
    scheduler-side connector has none, and is left alone)."""
    worker = getattr(connector, "connector_worker", None)
    if worker is None:
        return
    base = type(worker)
    worker.__class__ = type(f"{broken.__name__.strip('_')}({base.__name__})", (broken, base), {})
