"""The ``kvfail matrix`` heat map: colour by verdict category, every row, the counts drawn.

The matrix here is built from audit reports of the shape ``kvfail audit --format json``
writes (through :func:`kvfail.audit.matrix_table.cells_from_audit`), so the cells are read the
way ``kvfail matrix`` reads them; the picture is drawn into ``tmp_path``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvfail.audit import heatmap as h
from kvfail.audit import matrix as m
from kvfail.audit import matrix_table as mtable
from kvfail.compat import MISSING_FEATURE_MARK as MARK

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="requires matplotlib (dev.txt)"
)


def _f(check: str, status: str, tier: str = "STATIC") -> dict[str, Any]:
    return {"check": check, "status": status, "tier": tier, "level": "MUST"}


def _row(name: str, findings: list[dict[str, Any]], kind: str = "driver", why: str = "") -> dict:
    return {
        "name": name,
        "installed": True,
        "findings": findings,
        "coverage": {"kind": kind, "reason": why, "evidence": []},
    }


def _dyn(bad: int, total: int) -> list[dict[str, Any]]:
    return [_f(f"dyn:s{i}", "fail" if i < bad else "pass", "DYNAMIC") for i in range(total)]


def _gap(check: str) -> dict[str, Any]:
    """A scenario that ended in MissingFeatureError: the tool could not judge it."""
    found = _f(check, "unknown", "DYNAMIC")
    found["summary"] = f"the harness needs get_transfer_results (request_level_channel), {MARK}"
    return found


STATIC_OK = [_f("reports", "pass"), _f("deadline", "pass")]
NEW = {
    "dynamic_tier": "ran",
    "dynamic_incomplete": None,
    "connectors": [
        # Fails 3 of 13: a small share, still a failure.
        _row("ThreeOfThirteen", [*STATIC_OK, *_dyn(3, 13)]),
        _row("AllPass", [*STATIC_OK, *_dyn(0, 15)]),
        _row("Undecided", [_f("reports", "pass"), _f("request_channel", "unknown")], "unknown"),
        _row("StaticFail", [_f("reports", "fail"), _f("hma", "fail"), _f("x", "pass")]),
        _row("Blocked", STATIC_OK, "blocked", "package 'lmcache' is not installed"),
        _row("NeverLoads", STATIC_OK, "not_applicable", "never loads external KV"),
        _row("PartlyJudged", [*STATIC_OK, *_dyn(0, 4), _gap("dyn:two_groups")]),
        _row("NoneJudged", [*STATIC_OK, _gap("dyn:a"), _gap("dyn:b")]),
    ],
}
OLD = {
    "dynamic_tier": "skipped (--quick)",
    "dynamic_incomplete": None,
    "connectors": [_row("AllPass", STATIC_OK)],
}


def _matrix() -> mtable.Matrix:
    def run_(version: str, report: dict[str, Any], **kw: Any) -> mtable.VersionRun:
        return mtable.VersionRun(
            version,
            "py",
            1.0,
            cells=mtable.cells_from_audit(report),
            dynamic_tier=report["dynamic_tier"],
            **kw,
        )

    return mtable.Matrix(
        dynamic=True,
        runs=[
            run_("0.29.0", OLD),
            mtable.VersionRun("0.30.0", "py30", 0.1, error="audit child exited 1"),
            run_("0.32.0", NEW),
        ],
    )


def _grid() -> dict[tuple[str, str, bool], h.HeatCell]:
    mx = _matrix()
    return {
        (name, v, dyn): cell
        for name, row in zip(mx.connectors, h.cells(mx), strict=True)
        for (v, dyn), cell in zip(h.columns(mx), row, strict=True)
    }


def test_a_failing_cell_is_fail_with_its_counts_whatever_its_share() -> None:
    g = _grid()
    three = g["ThreeOfThirteen", "0.32.0", True]
    assert three.category is h.Category.FAIL and three.text.startswith("3/13 FAIL")
    assert g["AllPass", "0.32.0", True] == h.HeatCell(h.Category.PASS, "15/15 ok")
    static = g["StaticFail", "0.32.0", False]
    assert static.category is h.Category.FAIL and static.text == "2/3 FAIL\nreports,hma"
    many = mtable.Cell(
        static_fail=["request_channel", "hma", "no_raise", "deadline"], static_checked=9
    )
    # The ids that fit the cell, then how many more: the count stays exact.
    assert h.static_cell(many).text == "4/9 FAIL\nrequest_channel,hma +2"


def test_unknown_is_never_pass() -> None:
    cell = _grid()["Undecided", "0.32.0", False]
    assert cell.category is h.Category.UNKNOWN and "request_channel" in cell.text


def test_cells_without_a_verdict_say_why() -> None:
    g = _grid()
    assert g["Blocked", "0.32.0", True] == h.HeatCell(
        h.Category.BLOCKED, "blocked", "package 'lmcache' is not installed"
    )
    assert g["NeverLoads", "0.32.0", True].category is h.Category.NOT_APPLICABLE
    # A connector that version did not list, a tier that was not run, a child that failed.
    assert g["Blocked", "0.29.0", False] == h.HeatCell(h.Category.NOT_APPLICABLE, "absent")
    old_dynamic = g["AllPass", "0.29.0", True]
    assert old_dynamic.category is h.Category.NOT_RUN
    assert old_dynamic.reason == "vLLM 0.29.0: static tier only (kvfail matrix without --dynamic)"
    for dyn in (False, True):
        failed = g["AllPass", "0.30.0", dyn]
        assert failed.category is h.Category.NOT_RUN and "audit child exited 1" in str(
            failed.reason
        )


def test_scenarios_the_tool_could_not_judge_are_blocked_naming_the_feature() -> None:
    g = _grid()
    why = "MissingFeatureError): request_level_channel"
    partly = g["PartlyJudged", "0.32.0", True]
    assert partly.category is h.Category.PASS and partly.text == "4/4 ok\n+1 blocked"
    assert why in str(partly.reason)
    none = g["NoneJudged", "0.32.0", True]
    assert none.category is h.Category.BLOCKED and none.text == "2 blocked"
    assert why in str(none.reason)


def test_a_wheel_column_gives_the_wheels_reason() -> None:
    wheel = mtable.VersionRun(
        "0.33.0",
        "py",
        1.0,
        cells=mtable.cells_from_audit(OLD),
        dynamic_tier="skipped (--quick)",
        dynamic_incomplete="static tier only: read from the wheel's sources, not installed",
    )
    (row,) = h.cells(mtable.Matrix(False, [wheel]))
    assert row[0] == h.HeatCell(h.Category.PASS, "2/2 ok")
    assert row[1].category is h.Category.NOT_RUN and "wheel's sources" in str(row[1].reason)


def test_saved_results_keep_what_the_picture_needs() -> None:
    mx = _matrix()
    again = mtable.Matrix.from_json(json.loads(json.dumps(mx.to_json())))
    assert h.cells(again) == h.cells(mx)


def _rgb(colour: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    return to_rgb(colour)


@needs_matplotlib
def test_the_png_draws_every_row_each_colour_by_category_and_the_counts(tmp_path: Path) -> None:
    from matplotlib.image import imread
    from matplotlib.patches import Rectangle

    mx = _matrix()
    fig, ax = h.draw(mx)
    out = tmp_path / "heat.png"
    fig.savefig(out)
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == mx.connectors and len(names) == 8  # every row of the input
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == [
        "vLLM 0.29.0\nstatic",
        "vLLM 0.29.0\ndynamic",
    ]
    drawn = {t.get_text() for t in ax.texts}
    assert "3/13 FAIL" in drawn and "15/15 ok" in drawn and "2/3 FAIL\nreports,hma" in drawn
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert legend == {c.value for c in h.Category}

    fills = {p.get_gid(): p.get_facecolor()[:3] for p in ax.patches if isinstance(p, Rectangle)}
    row = mx.connectors.index("ThreeOfThirteen")
    col = h.columns(mx).index(("0.32.0", True))
    fail, ok = _rgb(h.COLOURS[h.Category.FAIL][0]), _rgb(h.COLOURS[h.Category.PASS][0])
    assert fills[f"cell:{row}:{col}"] == pytest.approx(fail)

    # The file itself: a pixel inside that cell (off its text) is the fail colour.
    pixels = imread(out)
    fig.canvas.draw()
    x, y = ax.transData.transform((col - 0.4, row - 0.35))
    r, g, b = pixels[int(pixels.shape[0] - y), int(x)][:3]
    assert (r, g, b) == pytest.approx(fail, abs=0.02)
    assert (r, g, b) != pytest.approx(ok, abs=0.1)
    undecided = mx.connectors.index("Undecided"), h.columns(mx).index(("0.32.0", False))
    assert fills["cell:{}:{}".format(*undecided)] != pytest.approx(ok)


@needs_matplotlib
def test_kvfail_matrix_heatmap_draws_saved_results(tmp_path: Path) -> None:
    import argparse

    saved = tmp_path / "m.json"
    saved.write_text(json.dumps(_matrix().to_json()))
    parser = argparse.ArgumentParser()
    m.add_parser(parser.add_subparsers())
    png = tmp_path / "out" / "heat.png"
    args = parser.parse_args(["matrix", "--load", str(saved), "--heatmap", str(png)])
    args.output = tmp_path / "table.txt"
    assert m.run(args) == 1  # the 0.30.0 child's error is the command's failure
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
