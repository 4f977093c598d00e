"""The fault-point gate: every fault point is injected by a registered driver and used by
a scenario, and no driver picks its faults with a conditional.

Why: a fault point is a promise in three places at once, the vocabulary
(``kvfail.faults.points``), a driver's fault table (``Driver.injectors``) and a scenario
that provokes it, and ``docs/contract.md`` lists it as testing its clauses. A point that
no driver injects, or that no scenario uses, tests nothing while the document says it
does. And a fault table only stays the one source of truth if no driver also dispatches
on fault points in an ``if``/``elif`` ladder beside it.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from functools import cache
from pathlib import Path

import pytest

from kvfail.conformance.driver import Driver, Injector
from kvfail.faults.points import FaultPoint

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "kvfail" / "conformance" / "scenarios"
#: Every module that defines a driver: the in-tree ones and the guide's example.
DRIVER_MODULES = (
    *sorted((ROOT / "kvfail" / "conformance").glob("*_driver.py")),
    ROOT / "tests" / "conformance" / "minimal_driver.py",
)


def _entry_points() -> dict[str, str]:
    """The ``kvfail.drivers`` entry points this checkout registers (``pyproject.toml``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    group: dict[str, str] = project["project"]["entry-points"]["kvfail.drivers"]
    return group


@cache
def _drivers() -> dict[str, Driver]:
    """Every registered driver, built (nothing started: no peer process runs)."""
    pytest.importorskip("vllm", reason="the registered drivers resolve vLLM's connectors")
    out = {}
    for name, target in _entry_points().items():
        module, attr = target.split(":")
        out[name] = getattr(importlib.import_module(module), attr)(name)
    return out


def _used_by_scenarios() -> dict[FaultPoint, list[str]]:
    """Fault point -> the scenario modules that name it (``FaultPoint.X``, by AST)."""
    used: dict[FaultPoint, list[str]] = {}
    for path in sorted(SCENARIOS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _is_fault_point(node):
                assert isinstance(node, ast.Attribute)
                used.setdefault(FaultPoint[node.attr], []).append(path.name)
    return used


def _is_fault_point(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "FaultPoint"
        and node.attr in FaultPoint.__members__
    )


def _untested(
    injected: dict[FaultPoint, list[str]], used: dict[FaultPoint, list[str]]
) -> list[str]:
    """Every fault point no driver injects or no scenario uses, and which it lacks."""
    out = []
    for point in FaultPoint:
        lacks = [
            what
            for what, where in (("no driver injects it", injected), ("no scenario uses it", used))
            if point not in where
        ]
        if lacks:
            out.append(f"{point.value}: {'; '.join(lacks)}")
    return out


@pytest.mark.vllm
def test_every_fault_point_is_injected_by_a_driver_and_used_by_a_scenario() -> None:
    injected: dict[FaultPoint, list[str]] = {}
    for name, driver in _drivers().items():
        for point in driver.faults:
            injected.setdefault(point, []).append(name)
    problems = _untested(injected, _used_by_scenarios())
    assert not problems, (
        "fault points that test nothing (implement them in a driver and a scenario, or "
        f"remove them from kvfail.faults.points and docs/contract.md): {problems}"
    )


def test_the_gate_names_a_point_nobody_injects() -> None:
    """Negative control: a point missing from every table, or from every scenario."""
    everywhere = {point: ["x"] for point in FaultPoint}
    no_driver = {p: w for p, w in everywhere.items() if p is not FaultPoint.REFUSE}
    assert _untested(no_driver, everywhere) == ["refuse: no driver injects it"]
    assert _untested(everywhere, no_driver) == ["refuse: no scenario uses it"]
    assert _untested(everywhere, everywhere) == []


@pytest.mark.vllm
def test_each_drivers_faults_are_its_table() -> None:
    for name, driver in _drivers().items():
        table = driver.injectors
        assert driver.faults == frozenset(table), name
        assert all(isinstance(i, Injector) for i in table.values()), name
        caps = driver.capabilities()  # a point needing an ability the driver lacks raises
        assert caps.faults == driver.faults, name


def _dispatches(source: str) -> list[str]:
    """Each ``if``/``elif``/``while``/conditional expression/``match`` in ``source`` whose
    test names a ``FaultPoint`` member."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests: list[ast.AST] = [node.test]
        elif isinstance(node, ast.Match):
            tests = [node.subject, *(case.pattern for case in node.cases)]
        else:
            continue
        for test in tests:
            if any(_is_fault_point(sub) for sub in ast.walk(test)):
                found.append(f"line {node.lineno}: {ast.unparse(test)}")
    return found


@pytest.mark.parametrize("path", DRIVER_MODULES, ids=lambda p: p.name)
def test_no_driver_dispatches_on_fault_points(path: Path) -> None:
    """What a fault does is its injector's, in the table: never a ladder beside it."""
    found = _dispatches(path.read_text(encoding="utf-8"))
    assert not found, f"{path.name} dispatches on fault points: {found}"


def test_the_dispatch_check_catches_a_ladder() -> None:
    """Negative control: the shapes a ladder takes are all named."""
    ladder = (
        "if point is FaultPoint.REFUSE:\n    a()\n"
        "elif point in (FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER):\n    b()\n"
        "x = 1 if fault is FaultPoint.NET_DELAY else 2\n"
        "match point:\n    case FaultPoint.FREEZE_PEER:\n        c()\n"
    )
    assert sorted(f.split(":")[0] for f in _dispatches(ladder)) == [
        "line 1",
        "line 3",
        "line 5",
        "line 6",
    ]
    assert _dispatches("table = {FaultPoint.REFUSE: 1}\nif point in table:\n    a()\n") == []


def test_the_example_driver_derives_its_faults_from_its_table() -> None:
    from tests.conformance.minimal_driver import make_driver

    driver = make_driver("minimal")
    assert driver.faults == frozenset(driver.injectors)
    with pytest.raises(ValueError, match="cannot provoke"):
        driver.injector(FaultPoint.KILL_BEFORE_PULL)
