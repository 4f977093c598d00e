"""The one breakage the store and push controls share: a real connector whose failures
are dropped, so a failed load goes out as a finished one.
"""

from __future__ import annotations

from typing import Any

from kvfail.compat import KVConnectorTransferResults

__all__ = ["DropsLoadErrors"]


class DropsLoadErrors:
    """Mixed in front of a real connector: every failure its worker found is dropped, so
    a failed load goes out as a finished one (no failed block, no failed request)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()  # type: ignore[misc]
        return set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
        )
