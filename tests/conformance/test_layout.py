"""``--layout`` values: names, P's TP size, what each layout requires, and bad input."""

from __future__ import annotations

import pytest

from kvfail.conformance.layout import (
    ALL_LAYOUTS,
    DEFAULT_LAYOUT,
    Layout,
    parse_layout_policies,
    parse_layouts,
)


@pytest.mark.parametrize(
    ("text", "d_tp", "p_tp", "groups", "requires"),
    [
        ("tp1", 1, 1, 1, ()),
        ("tp2", 2, 2, 1, ("tp2",)),
        ("tp2-g2", 2, 2, 2, ("tp2", "two_groups", "hma")),
        ("p2d1", 1, 2, 1, ("tp2", "hetero_tp")),
        ("p1d2", 2, 1, 1, ("tp2", "hetero_tp")),
        ("p1d2-g2", 2, 1, 2, ("tp2", "hetero_tp", "two_groups", "hma")),
    ],
)
def test_parse(text: str, d_tp: int, p_tp: int, groups: int, requires: tuple[str, ...]) -> None:
    layout = Layout.parse(text)
    assert (layout.tp_size, layout.p_tp, layout.num_kv_cache_groups) == (d_tp, p_tp, groups)
    assert layout.heterogeneous is (d_tp != p_tp)
    assert layout.requires == requires
    assert layout.name == text
    assert Layout.parse(layout.name) == layout


def test_same_tp_on_both_sides_is_the_homogeneous_layout() -> None:
    # One layout, one column: p2d2 is tp2, however it is written or built.
    assert Layout.parse("p2d2") == Layout.parse("tp2") == Layout(2, 1, 2)
    assert Layout.parse("p1d1-g2").name == "tp1-g2"
    assert len({Layout(2, 1), Layout(2, 1, 2), Layout(2, 1, 0)}) == 1


@pytest.mark.parametrize("bad", ["tp3", "p3d1", "p2d", "pd1", "p2d1-g3", "P2D1", "p2-d1"])
def test_unknown_layout_names_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError, match=r"unknown layout .*p2d1, p1d2"):
        Layout.parse(bad)


def test_all_includes_the_heterogeneous_layouts_once() -> None:
    names = [layout.name for layout in parse_layouts(["all"])]
    assert names == [layout.name for layout in ALL_LAYOUTS]
    assert {"tp1", "tp2", "tp1-g2", "tp2-g2", "p2d1", "p1d2"} == set(names)
    assert len(set(ALL_LAYOUTS)) == len(ALL_LAYOUTS)
    assert parse_layouts([]) == [DEFAULT_LAYOUT]


def test_policy_limit_on_a_heterogeneous_layout() -> None:
    layouts, only = parse_layout_policies(["tp1", "tp2-g2:recompute,p2d1:recompute", "p1d2"])
    assert [layout.name for layout in layouts] == ["tp1", "tp2-g2", "p2d1", "p1d2"]
    assert only == {
        Layout.parse("tp2-g2"): frozenset({"recompute"}),
        Layout.parse("p2d1"): frozenset({"recompute"}),
    }
    with pytest.raises(ValueError, match="unknown policy 'never'"):
        parse_layout_policies(["p1d2:never"])
