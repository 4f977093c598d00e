"""``docs/contract.md`` stays the definition of every clause the code cites.

Why: the clauses C1..C14 are cited by scenarios, findings, reports, baselines and the audit.
A citation of a clause the document does not define, or a document that lists scenarios,
checks or fault points the code no longer has (or misses ones it has), misleads the
reader the document is for. The lists are read from the code itself: the scenarios'
``@pytest.mark.clauses`` markers (by AST, so no vLLM is needed), the audit's
``CheckSpec`` entries, and ``kvfail.faults.points``. Also checked: the document points at
nothing outside the repository.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfail.audit.static import CHECKS
from kvfail.faults.points import CLAUSE_TITLES, FaultPoint

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "contract.md"
#: Where code that may cite a clause lives.
CODE_DIRS = ("kvfail", "connectors", "conformance", "tests", "bench", "e2e")
CLAUSE_RE = re.compile(r"\bC(\d{1,3})\b")
HEADING_RE = re.compile(r"^## (C\d+)\. ", re.M)
#: A list line inside a clause's section: ``- **Scenarios:** `a`, `b`.``
LIST_RE = re.compile(
    r"^- \*\*(Scenarios|Audit checks|Fault points):\*\*(.*?)(?=^- |^## |\Z)", re.M | re.S
)
NAME_RE = re.compile(r"`([^`]+)`")


def _code_files() -> Iterator[Path]:
    for top in CODE_DIRS:
        yield from (p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)
    yield from (ROOT / "conformance").rglob("*.toml")


def _sections() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    heads = list(HEADING_RE.finditer(text))
    out = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        out[m.group(1)] = text[m.end() : end]
    return out


def _listed(section: str, what: str) -> set[str]:
    for m in LIST_RE.finditer(section):
        if m.group(1) == what:
            return set(NAME_RE.findall(m.group(2)))
    raise AssertionError(f"no '- **{what}:**' line")


def _marker_args(node: ast.FunctionDef, name: str) -> list[str]:
    for dec in node.decorator_list:
        if (
            isinstance(dec, ast.Call)
            and isinstance(dec.func, ast.Attribute)
            and dec.func.attr == name
        ):
            return [a.value for a in dec.args if isinstance(a, ast.Constant)]
    return []


def _scenarios() -> dict[str, list[str]]:
    """Every scenario function (it carries a ``clauses`` marker) -> the clauses it cites,
    wherever the scenario modules live in the tree."""
    found: dict[str, list[str]] = {}
    for path in _code_files():
        if path.suffix != ".py" or "clauses(" not in path.read_text(encoding="utf-8"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                cited = _marker_args(node, "clauses")
                if cited:
                    found[node.name] = cited
    return found


def test_every_clause_cited_in_the_code_is_defined() -> None:
    defined = set(_sections())
    cited: dict[str, set[str]] = defaultdict(set)
    for path in _code_files():
        for m in CLAUSE_RE.finditer(path.read_text(encoding="utf-8", errors="replace")):
            cited[f"C{m.group(1)}"].add(str(path.relative_to(ROOT)))
    missing = {c: sorted(where)[:3] for c, where in cited.items() if c not in defined}
    assert not missing, f"clauses cited but not defined in docs/contract.md: {missing}"
    assert {str(c) for c in CLAUSE_TITLES} <= defined


def test_clauses_are_defined_once_in_order() -> None:
    heads = HEADING_RE.findall(DOC.read_text(encoding="utf-8"))
    assert heads == [f"C{i}" for i in range(1, len(heads) + 1)]


@pytest.mark.parametrize("clause", [str(c) for c in CLAUSE_TITLES])
def test_each_clause_lists_what_tests_it(clause: str) -> None:
    """Scenarios, audit checks and fault points, exactly as the code declares them."""
    section = _sections()[clause]
    for part in ("**Requires.**", "**Why.**", "**How the scheduler consumes it.**"):
        assert part in section, f"{clause}: no {part}"
    assert "**Upstream issues.**" in section, f"{clause}: no upstream issues"
    scenarios = {name for name, cited in _scenarios().items() if clause in cited}
    assert {n for n in _listed(section, "Scenarios") if n.startswith("test_")} == scenarios
    checks = {c.id for c in CHECKS if c.clause == clause}
    assert _listed(section, "Audit checks") == checks
    points = {p.value for p in FaultPoint if clause in {str(c) for c in p.clauses}}
    assert _listed(section, "Fault points") == points
    if not scenarios and not checks:
        assert "**Not tested, and why.**" in section, f"{clause}: untested without saying why"


def test_every_scenario_the_document_names_exists() -> None:
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", DOC.read_text(encoding="utf-8")))
    unknown = named - set(_scenarios())
    assert not unknown, f"docs/contract.md names scenarios that do not exist: {sorted(unknown)}"


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_the_docs_point_at_nothing_outside_the_repository(doc: str) -> None:
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    for outside in ("../", "/work/", "/check/", "shared/", "/home/", "/tmp/"):
        assert outside not in text, f"docs/{doc} points outside the repository: {outside}"
    for path in re.findall(r"`((?:kvfail|conformance|tests|docs|connectors)/[\w/.*-]+)`", text):
        if "*" in path:
            assert list(ROOT.glob(path)), path
        else:
            assert (ROOT / path).exists(), f"docs/{doc} names a missing path: {path}"


#: Paths that exist only on some machine: the repository must carry what it cites.
OUTSIDE = ("shared/reference", "../shared", "/work/", "/check/", "/home/")


def test_no_tracked_file_points_outside_the_repository() -> None:
    """Code comments and docs alike: a pointer to a machine's folder is dead for every reader."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=30
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an installed wheel): nothing tracked to scan")
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    offenders = []
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = ROOT / name
        if name == me or path.suffix in {".png", ".safetensors"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{name}: {o}" for o in OUTSIDE if o in text]
    assert not offenders, f"files point outside the repository: {offenders}"
