"""The negative controls' module docstring lists every toy control the self-test expects.

Why: the docstring is where a reader learns which breakages the suite proves it catches;
it once said "the same four breakages" long after the set had grown. Read by AST, so no
vLLM import is needed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "kvfail" / "conformance" / "negative" / "toy.py"


#: The dicts of toy controls: the TP 1 ones, and those that show only at TP 2.
TOY_TABLES = ("EXPECTED_FLAGS", "EXPECTED_FLAGS_TP2")


def _expected_flags(tree: ast.Module) -> set[str]:
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in TOY_TABLES
            and isinstance(node.value, ast.Dict)
        ):
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            found[node.target.id] = keys
    missing = [name for name in TOY_TABLES if name not in found]
    assert not missing, f"no {missing} dict literal in negative/toy.py"
    return set().union(*found.values())


def test_the_docstring_table_lists_every_toy_control() -> None:
    tree = ast.parse(MODULE.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    lines = doc.splitlines()
    rules = [i for i, ln in enumerate(lines) if re.fullmatch(r"=+(\s+=+)+", ln)]
    rows = lines[rules[1] + 1 : rules[2]]  # between the header's rule and the closing one
    listed = {m.group(1) for ln in rows if (m := re.match(r"``(\w+)``", ln))}
    assert listed == _expected_flags(tree)
    assert not re.search(r"\b(two|three|four|five|six|seven|eight|nine|ten) breakages", doc)
