"""Production connectors import nothing from the rig.

Why: a connector in ``connectors/`` ships to production, where the rig (the harness, the
fault tools, the peers, the conformance suite, the audit and ``kvfail.rig``) does not run
and must not be needed; the contract modules at the package root are what a connector may
import. Read from the source, so every import counts, lazy ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

CONNECTORS = Path(__file__).resolve().parents[2] / "connectors"
RIG = ("kvfail.rig", "kvfail.harness", "kvfail.faults", "kvfail.peers", "kvfail.conformance")
RIG += ("kvfail.audit",)


def _imports(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def _rig_imports(path: Path) -> list[str]:
    return [m for m in _imports(path) if m == "kvfail.rig" or m.startswith(tuple(RIG))]


def test_no_production_connector_imports_the_rig() -> None:
    sources = [p for p in CONNECTORS.rglob("*.py") if "tests" not in p.parts]
    assert sources
    leaks = {str(p.relative_to(CONNECTORS)): _rig_imports(p) for p in sources}
    assert not {p: m for p, m in leaks.items() if m}, leaks


def test_the_check_sees_a_rig_import(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text("def f():\n    from kvfail.rig.cpu_shim import x\n\nimport kvfail.tracker\n")
    assert _rig_imports(leaky) == ["kvfail.rig.cpu_shim", "kvfail.rig.cpu_shim.x"]
