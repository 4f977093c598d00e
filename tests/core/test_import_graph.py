"""kvfail's modules import each other without a cycle.

Why: a cycle (two modules that each import the other, even lazily inside a function)
means neither can be understood, tested or replaced alone, and it is how the driver API and
one transport's driver had grown into each other. The graph is read from the source, so
the test needs no import: every ``import``/``from ... import`` anywhere in a module counts,
except under ``if TYPE_CHECKING:``, which never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvfail"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, leaving out the bodies of ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    # ``from pkg import sub`` imports the submodule, not pkg's own body.
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_kvfail_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_check_sees_a_cycle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_driver_api_imports_no_transport_driver() -> None:
    graph = import_graph()
    assert "kvfail.conformance.nixl_driver" not in graph["kvfail.conformance.driver"]
    assert "kvfail.conformance.driver" in graph["kvfail.conformance.nixl_driver"]


def test_the_driver_api_imports_no_driver_at_all() -> None:
    """The API module is what every driver imports; a driver module (one per driver, each
    registered as an entry point) is never imported back by it."""
    graph = import_graph()
    drivers = {m for m in graph if m.startswith("kvfail.conformance.") and m.endswith("_driver")}
    assert {"toy_driver", "generic_driver", "pair_driver", "mooncake_driver"} <= {
        m.rpartition(".")[2] for m in drivers
    }
    assert not graph["kvfail.conformance.driver"] & drivers
