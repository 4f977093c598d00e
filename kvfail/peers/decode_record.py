"""What D observed for one request a pair added, and what that says about its bytes.

Why its own module: the record is shared by every transport's pair and read by the
pair drivers' byte oracle; the judgments over it (right bytes, wrong bytes, computed
locally) belong with the fields they read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DecodeRecord"]


@dataclass
class DecodeRecord:
    """What D observed for one request it added: one record for every transport's pair.

    The detection clock starts when the request is added, unless a driver injects its
    fault later (NIXL's kill once a READ is posted): then it moves ``injected_at`` and
    ``steps_at_injection`` to that moment."""

    req_id: str
    prompt_seed: str
    prompt_len: int
    params: dict[str, Any]
    added_at: float
    #: When the fault was injected (default: when the request was added).
    injected_at: float | None = None
    #: Seconds from injection (or add) to the first scheduler report naming the request.
    reported_s: float | None = None
    #: D engine steps from injection to that report.
    reported_steps: int | None = None
    failed: bool = False
    #: Bytes check at the first step the request ran after its load; None: never ran.
    verified: bool | None = None
    #: ``rank<r>:<layer>`` -> first bad positions; ``rank<r>`` with none: computed locally.
    mismatches: dict[str, list[int]] = field(default_factory=dict)
    checked_ranks: set[int] = field(default_factory=set)
    steps_at_injection: int = 0

    @property
    def wrong_loaded(self) -> dict[str, list[int]]:
        """The ``rank<r>:<layer>`` mismatches: loaded positions that did not hold P's
        bytes (a bare ``rank<r>`` only says that rank computed the request itself)."""
        return {k: v for k, v in self.mismatches.items() if ":" in k}

    def bytes_mismatch(self) -> str | None:
        """After a load that should have succeeded: None when D ran on P's bytes, else
        what went wrong (never ran, wrong positions, or computed locally)."""
        if self.verified is None:
            return f"{self.req_id} never ran after its load: no bytes were checked"
        if self.verified:
            return None
        wrong = self.wrong_loaded
        if wrong:
            return f"mismatched token positions {wrong}"
        # Only ``rank<r>`` entries: D computed the request itself (its load was reported
        # failed and the policy recomputed it), so no byte of P's was used, right or wrong.
        ranks = sorted(int(k.removeprefix("rank")) for k in self.mismatches)
        return f"{self.req_id} was computed locally on rank(s) {ranks}: nothing was loaded"

    def wrong_bytes(self) -> str | None:
        """After any load: why D ran this request on loaded KV that is not P's, else None
        (computed locally under ``recompute``: nothing loaded was used)."""
        wrong = self.wrong_loaded
        if not wrong:
            return None
        return f"{self.req_id} ran on loaded KV that is not P's: positions {wrong}"
