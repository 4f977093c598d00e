"""The ``kvfail matrix`` table: one cell per connector and vLLM release, read from each
release's ``kvfail audit --format json`` report, saved and merged as JSON.

Plain data: the runs that fill it (:mod:`kvfail.audit.matrix_runs`) and the renderings of
it (:mod:`kvfail.audit.matrix_render`, :mod:`kvfail.audit.heatmap`) read it from here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfail.audit.venvs import version_key
from kvfail.compat import MISSING_FEATURE_MARK

__all__ = ["Cell", "Matrix", "VersionRun", "cells_from_audit"]


@dataclass
class Cell:
    """One connector on one vLLM: its static verdict and, if run, its dynamic one."""

    present: bool = True
    static_fail: list[str] = field(default_factory=list)
    static_unknown: list[str] = field(default_factory=list)
    static_checked: int = 0
    #: (failed, run, not run) scenarios, or None when the dynamic tier did not run it.
    dynamic: tuple[int, int, int] | None = None
    #: Scenarios that ended in a :class:`kvfail.compat.MissingFeatureError`: the tool
    #: could not judge them on this vLLM (not among ``dynamic``'s counts).
    dynamic_errors: int = 0
    #: Each failed (or unjudged) dynamic scenario and the audit's summary of it.
    dynamic_failures: dict[str, str] = field(default_factory=dict)
    #: MUST/SHOULD levels of the failed static checks, by check id.
    levels: dict[str, str] = field(default_factory=dict)
    #: The audit's coverage of the row (``driver``, ``not_applicable``, ``blocked``,
    #: ``driver_not_built``, ``not_run``, ``unknown``) and its reason: why a row without
    #: dynamic verdicts has none (None in results saved before it was recorded).
    coverage: str | None = None
    coverage_reason: str = ""

    @property
    def static_text(self) -> str:
        if not self.present:
            return "absent"
        if self.static_fail:
            return "FAIL " + ",".join(self.static_fail)
        if self.static_unknown:
            return "? " + ",".join(self.static_unknown)
        return "ok"

    @property
    def dynamic_text(self) -> str:
        """The audit's own dynamic cell: ``ok n/n``, ``FAIL k/n``, ``+k not run``."""
        if self.dynamic is None or not self.present:
            return "-"
        bad, ran, not_run = self.dynamic
        if not ran:
            # Every scenario an error (kvfail's NIXL refusing a vLLM without the failed
            # set): say so, not "-", which reads as "no driver".
            parts = [f"+{self.dynamic_errors} error"] if self.dynamic_errors else []
            parts += [f"? {not_run} not run"] if not_run else []
            return " ".join(parts) or "-"
        text = f"FAIL {bad}/{ran}" if bad else f"ok {ran}/{ran}"
        if self.dynamic_errors:
            text += f" +{self.dynamic_errors} error"
        return f"{text} +{not_run} not run" if not_run else text

    def text(self, dynamic: bool) -> str:
        return f"{self.static_text} ; {self.dynamic_text}" if dynamic else self.static_text


@dataclass
class VersionRun:
    """What one venv's audit child produced (or why it produced nothing)."""

    version: str
    python: str
    elapsed_s: float
    error: str | None = None
    dynamic_incomplete: str | None = None
    cells: dict[str, Cell] = field(default_factory=dict)
    #: :func:`kvfail.compat.features` in that venv: why a clause can read differently.
    features: dict[str, bool] | None = None
    #: The audit's ``dynamic_tier``: ``ran``, or why not (``skipped (--quick)``).
    dynamic_tier: str | None = None


@dataclass
class Matrix:
    dynamic: bool
    runs: list[VersionRun]

    @property
    def versions(self) -> list[str]:
        return [r.version for r in self.runs]

    @property
    def connectors(self) -> list[str]:
        """Every connector seen on any version, in the newest version's order first."""
        out: list[str] = []
        for run_ in reversed(self.runs):
            out += [c for c in run_.cells if c not in out]
        return out

    def cell(self, connector: str, version: str) -> Cell:
        for run_ in self.runs:
            if run_.version == version:
                return run_.cells.get(connector, Cell(present=False))
        return Cell(present=False)

    def to_json(self) -> dict[str, Any]:
        return {"dynamic": self.dynamic, "runs": [asdict(r) for r in self.runs]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Matrix:
        runs = []
        for r in data["runs"]:
            cells = {}
            for name, c in r.pop("cells").items():
                dyn = c.pop("dynamic")
                cells[name] = Cell(**c, dynamic=None if dyn is None else tuple(dyn))
            runs.append(VersionRun(**r, cells=cells))
        return cls(dynamic=bool(data["dynamic"]), runs=runs)

    def merged(self, other: Matrix) -> Matrix:
        """This matrix with ``other``'s runs added; on a shared version, ``other``'s cells
        win connector by connector (separate runs of a few connectors each add up)."""
        runs = {r.version: r for r in self.runs}
        for r in other.runs:
            old = runs.get(r.version)
            if old is None or old.error:
                runs[r.version] = r
                continue
            cells = {**old.cells, **r.cells}
            for name, cell in r.cells.items():
                before = old.cells.get(name)
                if cell.dynamic is None and before is not None and before.dynamic is not None:
                    # A later static-only run refreshes the static verdict, keeps the
                    # dynamic one.
                    cells[name] = dataclasses.replace(
                        cell,
                        dynamic=before.dynamic,
                        dynamic_errors=before.dynamic_errors,
                        dynamic_failures=before.dynamic_failures,
                    )
            runs[r.version] = dataclasses.replace(
                r,
                cells=cells,
                elapsed_s=old.elapsed_s + r.elapsed_s,
                error=r.error if not r.cells else None,
                features=r.features or old.features,
                dynamic_tier=(
                    "ran"
                    if "ran" in (old.dynamic_tier, r.dynamic_tier)
                    else r.dynamic_tier or old.dynamic_tier
                ),
                dynamic_incomplete="; ".join(
                    x for x in (old.dynamic_incomplete, r.dynamic_incomplete) if x
                )
                or None,
            )
        ordered = sorted(runs.values(), key=lambda r: version_key(r.version))
        return Matrix(dynamic=self.dynamic or other.dynamic, runs=ordered)


def cells_from_audit(report: dict[str, Any]) -> dict[str, Cell]:
    """The cells of one ``kvfail audit --format json`` report, one per connector row."""
    cells: dict[str, Cell] = {}
    for row in report.get("connectors", []):
        if not row.get("installed", True):
            cells[row["name"]] = Cell(present=False)
            continue
        coverage = row.get("coverage") or {}
        cell = Cell(coverage=coverage.get("kind"), coverage_reason=coverage.get("reason", ""))
        bad = ran = not_run = errors = 0
        any_dynamic = False
        for f in row.get("findings", []):
            status = f.get("status")
            if f.get("tier") == "DYNAMIC":
                any_dynamic = True
                gap = status in ("fail", "unknown") and MISSING_FEATURE_MARK in json.dumps(f)
                if status == "fail" or gap:
                    cell.dynamic_failures[f["check"]] = str(f.get("summary", ""))[:400]
                if gap:  # a harness error: the audit keeps it unknown (older: failed)
                    errors += 1
                elif status == "fail":
                    bad += 1
                    ran += 1
                elif status == "pass":
                    ran += 1
                elif status == "unknown":
                    not_run += 1
                continue
            if status == "n/a":
                continue
            cell.static_checked += 1
            if status == "fail":
                cell.static_fail.append(f["check"])
                cell.levels[f["check"]] = f.get("level", "")
            elif status == "unknown":
                cell.static_unknown.append(f["check"])
        if any_dynamic:
            cell.dynamic = (bad, ran, not_run)
            cell.dynamic_errors = errors
        cells[row["name"]] = cell
    return cells
