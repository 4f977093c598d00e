"""Scheduler-side guard against re-advertising a hit whose load just failed (C12, #55297).

Under ``recompute`` the scheduler rewinds a failed request and asks the connector's
``get_num_new_matched_tokens`` again. A connector that answers with the same remote hit
loads, fails and reloads forever. The scheduler-side connector never sees worker errors
directly, only what reaches ``update_connector_output``: failed request ids, and (with one
KV-cache group) failed block ids. This guard maps those back to requests and vetoes the
next lookup for them.

Memory is bounded by requests the scheduler holds: entries go at ``forget`` (call it from
``request_finished``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfail.blocks import normalise_block_ids


class RelookupGuard:
    """Not thread-safe: the scheduler-side connector runs on the engine-core thread."""

    def __init__(self) -> None:
        self._loading: dict[str, frozenset[int]] = {}
        self._block_owner: dict[int, str] = {}
        self._failed: set[str] = set()

    def loading(self, req_id: str, block_ids: object) -> None:
        """The scheduler committed ``block_ids`` to an external load for ``req_id``."""
        self._drop_blocks(req_id)
        blocks = frozenset(normalise_block_ids(block_ids).flat)
        self._loading[req_id] = blocks
        for block in blocks:
            self._block_owner[block] = req_id

    def observe(
        self,
        finished_recving: Iterable[str] | None,
        failed_recving: Iterable[str] | None = (),
        invalid_block_ids: Iterable[int] | None = (),
    ) -> set[str]:
        """Feed one ``KVConnectorOutput``; returns the requests newly marked failed."""
        newly = {r for r in failed_recving or () if r not in self._failed}
        owner = self._block_owner
        for block in invalid_block_ids or ():
            req_id = owner.get(block)
            if req_id is not None and req_id not in self._failed:
                newly.add(req_id)
        self._failed |= newly
        for req_id in finished_recving or ():
            self._drop_blocks(req_id)
        return newly

    def allows_hit(self, req_id: str) -> bool:
        """False once a load for this request failed: the next lookup must be a miss."""
        return req_id not in self._failed

    def forget(self, req_id: str) -> None:
        self._drop_blocks(req_id)
        self._failed.discard(req_id)

    def __len__(self) -> int:
        return len(self._loading) + len(self._failed)

    def _drop_blocks(self, req_id: str) -> None:
        for block in self._loading.pop(req_id, ()):
            if self._block_owner.get(block) == req_id:
                del self._block_owner[block]
