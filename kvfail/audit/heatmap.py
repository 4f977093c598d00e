"""The ``kvfail matrix`` heat map: one colour per verdict, the counts written in the cell.

Why categories and not a ramp: a colour scaled by the share of scenarios failed drew a
row failing 3 of 13 nearly green, and an undecided check as a pass. Here a cell's colour
says only which verdict it holds (pass, fail, unknown, blocked, not applicable, not
run), and its text gives the counts, so a failure is red whatever its share. A cell
without a verdict says why where the data knows (a footnote under the picture).

:func:`cells` decides every cell from the matrix alone (no drawing, so tests read it);
:func:`draw` lays those cells out; :func:`render` writes the PNG.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfail.compat import MISSING_FEATURE_MARK

if TYPE_CHECKING:
    from kvfail.audit.matrix_table import Cell, Matrix, VersionRun

__all__ = ["Category", "HeatCell", "cells", "columns", "draw", "render"]


class Category(Enum):
    """A cell's verdict; the value is its legend's words."""

    PASS = "pass"
    FAIL = "fail"
    UNKNOWN = "unknown (?: not decided)"
    BLOCKED = "blocked (cannot be judged here)"
    NOT_APPLICABLE = "not applicable"
    NOT_RUN = "not run"


#: Fill and text colour per category: fail and pass far apart, and the cells with no
#: verdict in greys, so none of them reads as a pass.
COLOURS: dict[Category, tuple[str, str]] = {
    Category.PASS: ("#1b7837", "white"),
    Category.FAIL: ("#c0262d", "white"),
    Category.UNKNOWN: ("#f4b942", "black"),
    Category.BLOCKED: ("#6a3d9a", "white"),
    Category.NOT_APPLICABLE: ("#f2f2f2", "#333333"),
    Category.NOT_RUN: ("#bdbdbd", "black"),
}

_IDS_WIDTH = 26  # characters of failed check ids under a static count
#: How :class:`kvfail.compat.MissingFeatureError` names its feature in a summary.
_MISSING = re.compile(r"\((\w+)\), " + re.escape(MISSING_FEATURE_MARK))


@dataclass(frozen=True)
class HeatCell:
    """What one cell shows: its verdict, its words, and why it has no verdict."""

    category: Category
    text: str
    reason: str | None = None


def columns(matrix: Matrix) -> list[tuple[str, bool]]:
    """(version, dynamic?) per column: static and dynamic for every version, a tier
    that did not run included (it is drawn as not run, with its reason)."""
    return [(v, dyn) for v in matrix.versions for dyn in (False, True)]


def _ids(names: list[str]) -> str:
    """As many check ids as fit the cell, then how many more (``+2``)."""
    shown: list[str] = []
    for i, name in enumerate(names):
        rest = len(names) - i - 1
        more = f" +{rest}" if rest else ""
        if shown and len(",".join([*shown, name])) + len(more) > _IDS_WIDTH:
            return ",".join(shown) + f" +{len(names) - i}"
        shown.append(name)
    return ",".join(shown)


def static_cell(cell: Cell) -> HeatCell:
    """The static tier's verdict: failed checks out of those that apply."""
    if not cell.present:
        return HeatCell(Category.NOT_APPLICABLE, "absent")
    n = cell.static_checked
    if cell.static_fail:
        text = f"{len(cell.static_fail)}/{n} FAIL\n{_ids(cell.static_fail)}"
        return HeatCell(Category.FAIL, text)
    if cell.static_unknown:
        return HeatCell(
            Category.UNKNOWN, f"? {len(cell.static_unknown)}/{n}\n{_ids(cell.static_unknown)}"
        )
    if not n:
        return HeatCell(Category.NOT_APPLICABLE, "n/a")
    return HeatCell(Category.PASS, f"{n}/{n} ok")


def _extras(errors: int, not_run: int) -> str:
    parts = [f"+{errors} blocked"] if errors else []
    parts += [f"+{not_run} not run"] if not_run else []
    return "\n" + " ".join(parts) if parts else ""


def _blocked_reason(cell: Cell) -> str | None:
    """The features the unjudged scenarios needed, as their errors name them."""
    if not cell.dynamic_errors:
        return None
    named = {
        m.group(1) for summary in cell.dynamic_failures.values() for m in _MISSING.finditer(summary)
    }
    what = ", ".join(sorted(named)) or "named in the audit's report"
    return f"scenarios need a feature this vLLM lacks (MissingFeatureError): {what}"


def _tier_not_run(run_: VersionRun) -> str | None:
    """Why the dynamic tier did not run on this version at all (None: it ran, or the
    saved results do not say)."""
    if run_.error:
        return f"vLLM {run_.version}: no report ({run_.error})"
    if run_.dynamic_tier in (None, "ran"):
        return None
    why = run_.dynamic_incomplete or (
        "static tier only (kvfail matrix without --dynamic)"
        if run_.dynamic_tier.startswith("skipped (--quick)")
        else f"dynamic tier {run_.dynamic_tier}"
    )
    return f"vLLM {run_.version}: {why}"


def dynamic_cell(cell: Cell, run_: VersionRun | None) -> HeatCell:
    """The dynamic tier's verdict: failed scenarios out of those judged; without
    scenarios, the audit's coverage (not applicable, blocked) or why none ran."""
    if run_ is not None and run_.error:
        return HeatCell(Category.NOT_RUN, "not run", _tier_not_run(run_))
    if not cell.present:
        return HeatCell(Category.NOT_APPLICABLE, "absent")
    if cell.dynamic is not None:
        bad, ran, not_run = cell.dynamic
        errors, blocked = cell.dynamic_errors, _blocked_reason(cell)
        if bad:
            return HeatCell(Category.FAIL, f"{bad}/{ran} FAIL{_extras(errors, not_run)}", blocked)
        if ran:
            return HeatCell(Category.PASS, f"{ran}/{ran} ok{_extras(errors, not_run)}", blocked)
        if errors:
            # Every scenario ended in a missing feature: the tool could not judge one.
            return HeatCell(Category.BLOCKED, f"{errors} blocked{_extras(0, not_run)}", blocked)
        reason = run_.dynamic_incomplete if run_ is not None else None
        return HeatCell(Category.NOT_RUN, f"{not_run} not run", reason or "no scenario finished")
    if cell.coverage == "not_applicable":
        return HeatCell(Category.NOT_APPLICABLE, "n/a", cell.coverage_reason or None)
    if cell.coverage == "blocked":
        return HeatCell(Category.BLOCKED, "blocked", cell.coverage_reason or None)
    tier = _tier_not_run(run_) if run_ is not None else None
    return HeatCell(Category.NOT_RUN, "not run", tier or cell.coverage_reason or None)


def cells(matrix: Matrix) -> list[list[HeatCell]]:
    """Every row the matrix has (every connector any version listed), every column."""
    runs = {r.version: r for r in matrix.runs}
    return [
        [
            dynamic_cell(matrix.cell(name, v), runs.get(v))
            if dyn
            else (
                HeatCell(Category.NOT_RUN, "not run", _tier_not_run(runs[v]))
                if runs[v].error
                else static_cell(matrix.cell(name, v))
            )
            for v, dyn in columns(matrix)
        ]
        for name in matrix.connectors
    ]


def _footnotes(grid: list[list[HeatCell]]) -> dict[str, int]:
    """Each distinct reason, numbered in reading order."""
    notes: dict[str, int] = {}
    for row in grid:
        for c in row:
            if c.reason and c.reason not in notes:
                notes[c.reason] = len(notes) + 1
    return notes


# Layout, in inches: fixed margins so the axes are where tests (and readers) expect.
_CELL_W, _CELL_H = 1.55, 0.42
_LEFT, _RIGHT, _TOP = 2.5, 0.2, 0.95
_LEGEND_H, _NOTE_LINE_H = 0.55, 0.13
_NOTE_WIDTH = 150  # characters per footnote line


def draw(matrix: Matrix) -> tuple[Any, Any]:
    """The heat map as a matplotlib (figure, axes); cell (row i, column j) is the unit
    square centred on (j, i) in data coordinates."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as exc:  # pragma: no cover - dev requirement
        raise SystemExit(
            f"kvfail matrix: --heatmap needs matplotlib (requirements/dev.txt): {exc}"
        ) from None
    names = matrix.connectors
    if not names:
        raise SystemExit("kvfail matrix: nothing to draw (no version produced a report)")
    cols = columns(matrix)
    grid = cells(matrix)
    notes = _footnotes(grid)
    note_lines = [
        line
        for reason, n in notes.items()
        for line in textwrap.wrap(f"[{n}] {reason}", _NOTE_WIDTH, subsequent_indent="     ")
    ]
    plot_w, plot_h = _CELL_W * len(cols), _CELL_H * len(names)
    bottom = _LEGEND_H + _NOTE_LINE_H * (len(note_lines) + 1)
    width = max(_LEFT + plot_w + _RIGHT, 9.0)
    height = _TOP + plot_h + bottom
    fig = plt.figure(figsize=(width, height), dpi=110)
    ax = fig.add_axes((_LEFT / width, bottom / height, plot_w / width, plot_h / height))
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(names) - 0.5, -0.5)
    for i, row in enumerate(grid):
        for j, c in enumerate(row):
            fill, ink = COLOURS[c.category]
            ax.add_patch(
                Rectangle(
                    (j - 0.5, i - 0.5),
                    1,
                    1,
                    facecolor=fill,
                    edgecolor="white",
                    linewidth=1.5,
                    gid=f"cell:{i}:{j}",
                )
            )
            text = c.text + (f" [{notes[c.reason]}]" if c.reason else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color=ink, linespacing=1.1)
    # A thicker line between versions: static | dynamic belong together.
    for j in range(2, len(cols), 2):
        ax.axvline(j - 0.5, color="#444444", linewidth=1.2)
    labels = [f"vLLM {v}\n{'dynamic' if dyn else 'static'}" for v, dyn in cols]
    ax.set_xticks(range(len(cols)), labels, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.suptitle(
        "kvfail audit by vLLM version: static checks failed / applicable, "
        "dynamic scenarios failed / judged",
        fontsize=9,
        y=1 - 0.12 / height,
    )
    legend = [Patch(facecolor=COLOURS[c][0], edgecolor="#666666", label=c.value) for c in Category]
    fig.legend(
        handles=legend,
        loc="lower left",
        bbox_to_anchor=(0.1 / width, (bottom - _LEGEND_H + 0.1) / height),
        ncol=len(legend),
        fontsize=7.5,
        frameon=False,
    )
    if note_lines:
        fig.text(
            0.1 / width,
            (bottom - _LEGEND_H) / height,
            "\n".join(note_lines),
            ha="left",
            va="top",
            fontsize=6.5,
            family="monospace",
            linespacing=1.3,
        )
    return fig, ax


def render(matrix: Matrix, path: Path) -> None:
    """Write the heat map to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig, _ = draw(matrix)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
