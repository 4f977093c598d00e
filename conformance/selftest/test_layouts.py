"""The layout axis: parsing ``--layout`` and the matrix's columns when several ran."""

from __future__ import annotations

from typing import Any

import pytest

from kvfail.conformance.layout import ALL_LAYOUTS, DEFAULT_LAYOUT, Layout, parse_layouts
from kvfail.conformance.report import Record, render_matrix


def test_parse_layouts_accepts_lists_all_and_dedupes() -> None:
    assert parse_layouts([]) == [DEFAULT_LAYOUT]
    assert parse_layouts(["tp2-g2,tp1", "tp1"]) == [Layout(2, 2), Layout(1, 1)]
    assert parse_layouts(["all"]) == list(ALL_LAYOUTS)
    assert [layout.name for layout in ALL_LAYOUTS] == ["tp1", "tp2", "tp1-g2", "tp2-g2"]
    assert Layout(2, 2).requires == ("tp2", "two_groups", "hma")
    with pytest.raises(ValueError, match="unknown layout 'tp4'"):
        parse_layouts(["tp4"])


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


def test_a_layout_finding_marks_only_failed_load_checks_in_its_layouts() -> None:
    """A known upstream finding tied to a layout (NIXL, two KV-cache groups) applies to
    that connector in layouts needing that capability only, and turns a scenario into a
    strict xfail only when the scenario expects a failed load."""
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
    from kvfail.conformance.driver import ToyDriver
    from kvfail.conformance.plugin import layout_finding
    from kvfail.conformance.suite import ScenarioContext

    reason = layout_finding("NixlPullConnector", Layout(1, 2))
    assert reason is not None and "invalid_block_ids" in reason
    assert layout_finding("NixlPullConnector", Layout(2, 2)) == reason
    assert layout_finding("NixlPullConnector", Layout(2, 1)) is None
    assert layout_finding("KvfailNixlConnector", Layout(1, 2)) is None

    class Node:
        def __init__(self) -> None:
            self.marks: list[pytest.Mark] = []

        def add_marker(self, mark: pytest.MarkDecorator) -> None:
            self.marks.append(mark.mark)

    driver = ToyDriver()

    def context(node: Node, **findings: Any) -> ScenarioContext:
        return ScenarioContext(
            driver=driver,
            caps=driver.capabilities(),
            policy="fail",
            scenario="test_x",
            node=node,  # type: ignore[arg-type]
            **findings,
        )

    for failed, expected in ((False, []), (None, []), (True, [reason])):
        node = Node()
        ctx = context(node, failed_load_finding=reason)
        engine = ctx.engine()
        try:
            ctx.check(engine, [], failed=failed)
        finally:
            ctx.close()
        assert [m.kwargs["reason"] for m in node.marks] == expected
        assert all(m.name == "xfail" and m.kwargs["strict"] for m in node.marks)

    # A scenario that builds its own two-group engine in the tp1 layout meets it too.
    node = Node()
    ctx = context(
        node, layout_findings=lambda layout: reason if layout.num_kv_cache_groups > 1 else None
    )
    try:
        ctx.check(ctx.engine(), [], failed=True)
        assert node.marks == []
        ctx.check(ctx.engine(num_kv_cache_groups=2), [], failed=True)
    finally:
        ctx.close()
    assert [m.kwargs["reason"] for m in node.marks] == [reason]
