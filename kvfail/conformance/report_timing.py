"""Findings about when a load's report reached the scheduler: a failure after its finish
(C3) and a report past the declared deadline, or none at all (C10).

Why apart from the scenario context: these judge the scheduler's record of one run, with
nothing to wait for or drive; every scenario family calls them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvfail.conformance import timebase

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine

__all__ = ["DEADLINE_MARGIN_FLOOR_S", "check_not_late", "deadline_findings", "declared_text"]

#: A report later than the declared deadline + max(this floor, the deadline) is late: a
#: margin for the drain after the deadline and for a loaded machine, never a timing claim.
DEADLINE_MARGIN_FLOOR_S = 3.0


def check_not_late(engine: Engine, request_id: str, blocks: Iterable[int]) -> list[str]:
    """C3: no failure for ``request_id`` reaches the scheduler after its finished pass.

    ``blocks`` are the block ids its load used (read while it waited). A report naming
    the id in ``failed_recving`` or any of those blocks in ``invalid_block_ids`` after the
    step that carried ``request_id`` in ``finished_recving`` is late: the scheduler either
    drops it (bad blocks cached as valid) or treats it as a sync failure.
    """
    mine = set(blocks)
    reports = engine.record.scheduler_reports()
    finished = [r.step for r in reports if request_id in r.finished_recving]
    if not finished:
        return []
    first = min(finished)
    out: list[str] = []
    for r in reports:
        if r.step <= first:
            continue
        late_blocks = sorted(mine & r.invalid_block_ids)
        if request_id in r.failed_recving or late_blocks:
            what = f"blocks {late_blocks}" if late_blocks else "failed_recving"
            out.append(
                f"C3 late: failure of {request_id} ({what}) reached the scheduler at step "
                f"{r.step}, after finished_recving at step {first}"
            )
    return out


def declared_text(deadline: float | None) -> str:
    return "declares no deadline" if deadline is None else f"declares {deadline:g} s"


def deadline_findings(
    rids: Sequence[str],
    stranded: Iterable[str],
    times: Iterable[float],
    deadline: float | None,
    budget: float,
) -> list[str]:
    """C10 for loads only the connector's deadline can end: any still unreported after the
    suite's wait (``stranded``), and reports (``times``, seconds after each was added)
    later than the declared deadline + a margin."""
    out: list[str] = []
    left = sorted(stranded)
    one = len(rids) == 1
    if left:
        what = left[0] if one else f"{len(left)} of {len(rids)} loads ({left})"
        out.append(
            f"C10 no deadline: {what} unreported after the suite's wait of {budget:g} s; "
            f"the connector {declared_text(deadline)}"
        )
    if deadline is not None:
        margin = timebase.scaled(max(DEADLINE_MARGIN_FLOOR_S, deadline))
        late = [t for t in times if t > deadline + margin]
        if late:
            what = (
                f"{rids[0]} reported after {late[0]:.1f} s"
                if one
                else f"{len(late)} loads reported after up to {max(late):.1f} s"
            )
            out.append(f"C10 past deadline: {what}; deadline {deadline:g} s + margin {margin:g} s")
    return out
