"""Negative controls: connectors broken in exactly ONE way, that the suite must flag.

Why: a conformance suite that passes every connector proves nothing. Each class below is
the working :class:`~kvfail.harness.toy.ToyConnector` (a test double) with one contract
rule broken, the way real connectors broke it upstream; ``conformance/selftest`` runs the
suite against each (``--connector kvfail.conformance.negative:<Class>``) and asserts it is
flagged by the right scenario for the right clause, while the unbroken toy passes. When a
real connector lands they can be re-based on it the same way (override one hook).

=========================  ===========================================  =======  =========
class                      what is broken                               clause   flagged by
=========================  ===========================================  =======  =========
``SwallowsFailure``        a failed load is only logged, never reported C1/C2    stall
                           (pre-#50984 Mooncake): the request waits
``ReportsLate``            failures are reported one pass after the id  C3       late
                           was reported in ``finished_recving``
``ReportsUnknownId``       a failure also reports an id the scheduler   C7       crash
                           never tracked (stale/duplicate notification)
``ReportsSuccessOnFailure``a failed transfer is reported as a plain     C1       unreported
                           success with wrong bytes (the HF3FS pattern)
=========================  ===========================================  =======  =========
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvfail.harness.toy import ToyConnector
from kvfail.stages import Stage

__all__ = [
    "EXPECTED_FLAGS",
    "ReportsLate",
    "ReportsSuccessOnFailure",
    "ReportsUnknownId",
    "SwallowsFailure",
]

log = logging.getLogger("kvfail.conformance.negative")


class SwallowsFailure(ToyConnector):
    """Logs a failed load and drops it: no ``finished_recving``, so the request stalls."""

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
    ) -> bool:
        log.warning("load %s failed (%s): %s", req_id, stage, reason)  # and nothing else
        return True


class ReportsLate(ToyConnector):
    """Reports ``finished_recving`` on time but holds the failure back one pass (C3)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late_blocks: set[int] = set()
        self._late_ids: set[str] = set()
        self._held_blocks: set[int] = set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        late, self._late_ids = self._late_ids, set(results.failed_recving)
        results.failed_recving = late
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        now = super().get_block_ids_with_load_errors()
        late, self._held_blocks = self._held_blocks, set(now)
        return late


class ReportsUnknownId(ToyConnector):
    """Whenever it reports a failure, also reports a retry id the scheduler never saw."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self._kvfail_invalid or results.failed_recving:
            failed = set(results.failed_recving) or set(results.finished_recving)
            results.finished_recving |= {f"{rid}-retry" for rid in failed}
        return results


class ReportsSuccessOnFailure(ToyConnector):
    """A failed transfer is reported as success; D's blocks keep whatever was there."""

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        settle: bool = True,
        block_ids: object = None,
    ) -> bool:
        self._inflight.pop(req_id, None)  # no bytes are copied
        return self.load_succeeded(req_id)


#: What the self-test expects each control to be flagged by: (scenario, clause in reason).
EXPECTED_FLAGS: dict[str, tuple[str, str]] = {
    "SwallowsFailure": ("test_failed_load_one_group", "C2/C10 liveness"),
    "ReportsLate": ("test_failed_load_one_group", "C3 late"),
    "ReportsUnknownId": ("test_failed_load_one_group", "C7 crash"),
    "ReportsSuccessOnFailure": ("test_failed_load_one_group", "C1 unreported"),
}
