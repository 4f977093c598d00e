"""The suite's waits in this machine's time: one scale, measured before each scenario.

Every wait that decides a verdict (a real transport's budget, the silent-peer wait, the
margin past a declared deadline, the wait for held blocks and for a late write) goes
through :func:`scaled`, so a loaded machine gives a healthy connector the time it would
have had on an idle one. The scale is noted in each scenario's record
(``time_scale``), so a verdict shows what it allowed. A connector's own declared deadline
is never scaled: it is the connector's claim, judged as declared.
"""

from __future__ import annotations

from kvfail.rig.contention import MAX_FACTOR, ContentionMeter

__all__ = ["MAX_FACTOR", "current", "measure", "scaled"]

_meter: ContentionMeter | None = None
_scale = 1.0


def measure() -> float:
    """Measure the machine now and make that the scale of the waits that follow."""
    global _meter, _scale
    if _meter is None:
        _meter = ContentionMeter()
    _scale = _meter.measure()
    return _scale


def current() -> float:
    """The scale now in force (1.0 before any measurement)."""
    return _scale


def scaled(seconds: float) -> float:
    """``seconds`` of an idle machine, in this machine's time now."""
    return seconds * _scale
