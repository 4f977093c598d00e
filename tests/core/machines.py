"""The state-machine base the tracker's Hypothesis tests share.

Both :mod:`tests.core.test_stateful` (a naive model) and :mod:`tests.core.test_properties`
(one rule per property) drive one :class:`LoadTracker` on a manual clock with a fence
the rules can make refuse; building it in one place keeps the two checking the same
tracker set-up.
"""

from __future__ import annotations

from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from kvfail import LoadTracker
from tests.core.fakes import ManualClock


class TrackerStateMachine(RuleBasedStateMachine):
    """One tracker with ``GROUPS`` KV-cache groups, its clock in :attr:`clock` and its
    fence answering :attr:`fence_ok`; no rules of its own."""

    GROUPS = 1

    def __init__(self, **tracker_kwargs: Any) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.fence_ok = True
        self.tracker = LoadTracker(
            num_kv_cache_groups=self.GROUPS,
            clock=self.clock,
            fence=lambda _req: self.fence_ok,
            **tracker_kwargs,
        )
