"""Negative controls for the guard: ``KvfailGuardConnector`` broken in exactly one way.

Why: the guard's verdicts (``--connector guard:X``) are evidence only if the suite flags a
guard that breaks its promises over the same real transport. Each class here is the
working guard with one method changed; ``conformance/selftest/test_guard_controls.py``
runs the suite against each over real Mooncake and asserts the named scenario flags it
for the named clause, while the unbroken guard passes that scenario.

=====================  =====================================================  =========
class                  what is broken                                         flagged by
=====================  =====================================================  =========
``FreesAtDeadline``    fails an overdue load at its deadline and frees its    C11
                       blocks at once (no quarantine), though the slow P's    integrity
                       push still lands in them later
``DropsLateFailure``   reads the inner's failed blocks only after it          C1
                       delivered the step's completions, so a failure that    unreported
                       comes with (or after) its completion is dropped as
                       late: the failed load is reported as a success
=====================  =====================================================  =========

The suite names the inner connector each guards (:data:`GUARD_INNER`, given as
``--connector kvfail.conformance.guard_negative:<Class>?inner=<X>``), and that
connector's own driver runs it, as ``guard:X`` does; the class under test never chooses.
"""

from __future__ import annotations

from typing import Any

from connectors.guard import KvfailGuardConnector

__all__ = ["EXPECTED_GUARD_FLAGS", "GUARD_INNER", "DropsLateFailure", "FreesAtDeadline"]

#: The inner connector the selftest runs each control around (a ``--connector`` value).
GUARD_INNER = "vllm:MooncakeConnector"


class FreesAtDeadline(KvfailGuardConnector):
    """Claims every overdue load fenced: the tracker frees it at the deadline."""

    def kvfail_fence(self, req_id: str) -> bool:
        return True


class DropsLateFailure(KvfailGuardConnector):
    """Absorbs the inner's failed blocks after the drain instead of before it."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        self._late_invalid = self._guard_inner.get_block_ids_with_load_errors()
        inner = self._guard_inner
        self._guard_inner = _NoErrors(inner)  # the correct order, minus the errors
        try:
            return super().get_transfer_results(finished_req_ids)
        finally:
            self._guard_inner = inner

    def get_block_ids_with_load_errors(self) -> set[int]:
        late, self._late_invalid = getattr(self, "_late_invalid", set()), set()
        self._absorb_invalid(late)  # the loads were delivered: nothing left to fail
        return super().get_block_ids_with_load_errors()


class _NoErrors:
    """The inner connector, with its failed blocks already taken."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


#: control -> the (scenario that must flag it, text its reason must hold) pairs.
EXPECTED_GUARD_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    # A late write lands in the freed blocks whether P is slow or shutting down.
    "FreesAtDeadline": (
        ("test_slow_peer_writes_after_deadline", "C11"),
        ("test_p_shutdown_mid_write", "C11"),
    ),
    "DropsLateFailure": (("test_failed_load_one_group", "C1"),),
}
