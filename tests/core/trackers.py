"""The tracker the tracker tests build: on a manual clock, so no deadline test sleeps.

One factory for every test module of :class:`kvfail.LoadTracker`, so they all build the
same tracker and a new default (a keyword every test wants) is set in one place.
"""

from __future__ import annotations

from typing import Any

from kvfail import LoadTracker
from tests.core.fakes import ManualClock


def make_tracker(**kw: Any) -> LoadTracker:
    """A tracker with ``kw``, on a fresh :class:`ManualClock` unless ``clock`` is given."""
    kw.setdefault("clock", ManualClock())
    return LoadTracker(**kw)
