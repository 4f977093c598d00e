"""The layout axis: parsing ``--layout`` and the matrix's columns when several ran."""

from __future__ import annotations

import pytest

from kvfail.conformance.layout import (
    ALL_LAYOUTS,
    DEFAULT_LAYOUT,
    Layout,
    parse_layout_policies,
    parse_layouts,
)
from kvfail.conformance.report import Record, render_matrix


def test_parse_layouts_accepts_lists_all_and_dedupes() -> None:
    assert parse_layouts([]) == [DEFAULT_LAYOUT]
    assert parse_layouts(["tp2-g2,tp1", "tp1"]) == [Layout(2, 2), Layout(1, 1)]
    assert parse_layouts(["all"]) == list(ALL_LAYOUTS)
    assert [layout.name for layout in ALL_LAYOUTS] == [
        "tp1",
        "tp2",
        "tp1-g2",
        "tp2-g2",
        "p2d1",
        "p1d2",
    ]
    assert Layout(2, 2).requires == ("tp2", "two_groups", "hma")
    assert Layout(1, 1, 2).requires == ("tp2", "hetero_tp")
    with pytest.raises(ValueError, match="unknown layout 'tp4'"):
        parse_layouts(["tp4"])


def test_a_layout_may_be_limited_to_some_policies() -> None:
    layouts, only = parse_layout_policies(["tp1", "tp2-g2:recompute"])
    assert layouts == [Layout(1, 1), Layout(2, 2)]
    assert only == {Layout(2, 2): frozenset({"recompute"})}
    layouts, only = parse_layout_policies(["all:fail+recompute"])
    assert layouts == list(ALL_LAYOUTS) and set(only) == set(ALL_LAYOUTS)
    assert parse_layouts(["tp2:fail"]) == [Layout(2, 1)]
    with pytest.raises(ValueError, match="unknown policy 'retry' in 'tp2:retry'"):
        parse_layout_policies(["tp2:retry"])


def test_a_limited_layout_runs_only_its_policies(pytester: pytest.Pytester) -> None:
    """The matrix the session parametrizes: tp1 under both policies, tp2-g2 under one."""
    pytester.makepyfile("def test_x(kvfail_connector, kvfail_policy, kvfail_layout):\n    pass\n")
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--collect-only", "-q",
        "--connector", "toy", "--layout", "tp1,tp2-g2:recompute",
    )  # fmt: skip
    ids = sorted(line.split("[", 1)[1].rstrip("]") for line in result.outlines if "[" in line)
    assert ids == ["toy-fail", "toy-recompute", "toy-recompute-tp2-g2"], result.outlines


def _record(policy: str, layout: str, outcome: str = "passed") -> Record:
    return Record("c", "test_x", policy, outcome, "", ["C1"], 0.1, layout=layout)  # type: ignore[arg-type]


def test_matrix_has_a_column_per_policy_and_layout_only_when_several_ran() -> None:
    one = render_matrix([_record("fail", "tp1"), _record("recompute", "tp1")], markdown=True)
    assert "| scenario | clauses | fail | recompute |" in one
    several = render_matrix(
        [_record("fail", "tp1"), _record("fail", "tp2-g2", "failed")], markdown=True
    )
    assert "| scenario | clauses | fail tp1 | fail tp2-g2 |" in several
    assert "| test_x | C1 | passed | failed |" in several
