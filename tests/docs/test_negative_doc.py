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
MODULE = ROOT / "kvfail" / "conformance" / "negative.py"


def _expected_flags(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "EXPECTED_FLAGS"
            and isinstance(node.value, ast.Dict)
        ):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("no EXPECTED_FLAGS dict literal in negative.py")


def test_the_docstring_table_lists_every_toy_control() -> None:
    tree = ast.parse(MODULE.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    lines = doc.splitlines()
    rules = [i for i, ln in enumerate(lines) if re.fullmatch(r"=+(\s+=+)+", ln)]
    rows = lines[rules[1] + 1 : rules[2]]  # between the header's rule and the closing one
    listed = {m.group(1) for ln in rows if (m := re.match(r"``(\w+)``", ln))}
    assert listed == _expected_flags(tree)
    assert not re.search(r"\b(two|three|four|five|six|seven|eight|nine|ten) breakages", doc)
