"""``CONTRIBUTING.md``'s recipes, made in a scratch copy of the tree and run through the gates.

Why: a guide that names the wrong files sends a newcomer's first change to review broken, and
nothing else notices when code moves and the guide stays behind. Each recipe below is the
change a newcomer makes by following one "Add a ..." section: a fault point, a scenario, a
driver, an audit check, a connector. The test checks that

1. each section's "Files it touches" list names exactly the files its recipe edits;
2. all five recipes, made in one scratch copy, pass the gates that notice such a change (the
   contract document's lists, the fault-point specs, the audit's static checks, the driver
   registry, the audit's rows);
3. with the ``docs/contract.md`` step left out, the contract gate fails naming the new fault
   point, scenario and audit check: that step of the guide is needed, not decoration.

Only kvfail's own source and tests are copied, and the gates read code by AST or import no
transport, so no real transport runs here. A recipe whose anchor is gone means the code
moved: update the recipe and the section of ``CONTRIBUTING.md`` together.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "CONTRIBUTING.md"
#: What the scratch copy needs: the code the gates read, the gates, and the documents.
COPIED = ("kvfail", "connectors", "conformance", "tests", "docs", "bench", "e2e")
COPIED_FILES = ("pyproject.toml", "CONTRIBUTING.md")
#: The clause each scratch item cites (any would do; one each, so that with the contract
#: step left out each clause's gate fails on its own item).
POINT_CLAUSE, SCENARIO_CLAUSE, CHECK_CLAUSE = "C7", "C8", "C9"
#: The gates that notice the changes; all run in one child pytest over the scratch copy.
GATES = (
    "tests/docs/test_contract_doc.py",
    "tests/faults/test_points.py",
    "tests/audit/test_static.py",
    "tests/docs/test_scratch_recipes.py",
    "tests/conformance/test_fault_gate.py",
)
#: The driver the fault-point recipe adds its point to (one driver is enough for the gate).
POINT_DRIVER = "kvfail/conformance/toy_driver.py"


@dataclass
class Recipe:
    section: str
    #: path -> how the file changes (its old text, or None for a new file -> its new text).
    edits: dict[str, Callable[[str | None], str]] = field(default_factory=dict)
    #: Listed paths the recipe does not need to touch (the guide says "only if ...").
    optional: frozenset[str] = frozenset()


def _after(anchor: str, text: str) -> Callable[[str | None], str]:
    """Insert ``text`` after the first match of the regex ``anchor``."""

    def edit(old: str | None) -> str:
        assert old is not None
        m = re.search(anchor, old, re.S | re.M)
        assert m, f"anchor {anchor!r} is gone: the code moved; update the recipe and the guide"
        return old[: m.end()] + text + old[m.end() :]

    return edit


def _new(text: str) -> Callable[[str | None], str]:
    def edit(old: str | None) -> str:
        assert old is None, "the recipe creates this file"
        return textwrap.dedent(text).lstrip()

    return edit


def _append(text: str) -> Callable[[str | None], str]:
    def edit(old: str | None) -> str:
        assert old is not None
        return old + textwrap.dedent(text)

    return edit


def _contract_lists(clause: str, line: str, name: str) -> Callable[[str | None], str]:
    """Add ``name`` to one list line (``Scenarios``, ``Audit checks``, ``Fault points``)
    of a clause's section in ``docs/contract.md``."""
    return _after(rf"^## {clause}\. .*?^- \*\*{line}:\*\* ", f"`{name}`, ")


CONTRACT = "docs/contract.md"

RECIPES = [
    Recipe(
        "Add a fault point",
        {
            "kvfail/faults/points.py": lambda old: _after(
                r"^FAULT_SPECS: .*?\(\n    \{\n",
                f'        FaultPoint.SCRATCH_POINT: _spec("a scratch fault", Detection.ACTIVE, '
                f'Injection.PEER, "{POINT_CLAUSE}"),\n',
            )(
                _after(
                    r"^class FaultPoint\(.*?\):\n    \"\"\".*?\"\"\"\n\n",
                    '    SCRATCH_POINT = "scratch_point"\n',
                )(old)
            ),
            POINT_DRIVER: _after(
                r"def injectors\(self\).*?return \{\n",
                "            FaultPoint.SCRATCH_POINT: _ToyInjector(),\n",
            ),
            CONTRACT: _contract_lists(POINT_CLAUSE, "Fault points", "scratch_point"),
        },
    ),
    Recipe(
        "Add a scenario",
        {
            "kvfail/conformance/scenarios/test_scenarios.py": _append(
                f'''

                @pytest.mark.clauses("{SCENARIO_CLAUSE}")
                def test_scratch_scenario(scenario: ScenarioContext) -> None:
                    """A scenario made by following CONTRIBUTING.md."""
                    scenario.require_fault(FaultPoint.SCRATCH_POINT)
                '''
            ),
            CONTRACT: _contract_lists(SCENARIO_CLAUSE, "Scenarios", "test_scratch_scenario"),
        },
    ),
    Recipe(
        "Add an audit check",
        {
            "kvfail/audit/static.py": lambda old: _after(
                r"^CHECKS: tuple\[CheckSpec, \.\.\.\] = \(\n",
                f'    CheckSpec("scratch", "no scratch marker", "{CHECK_CLAUSE}", "SHOULD", '
                '"none", run=check_scratch),\n',
            )(
                _after(
                    r"\n\n(?=#: Every static check)",
                    "def check_scratch(ctx: CheckContext) -> Finding:\n"
                    '    found = ctx.model.method("scratch_marker") is not None\n'
                    '    return Finding("scratch", FAIL if found else PASS, '
                    '"marker" if found else "none")\n\n\n',
                )(old)
            ),
            CONTRACT: _contract_lists(CHECK_CLAUSE, "Audit checks", "scratch"),
            "tests/audit/fixtures/scratch_marker.py": _new(
                '''
                """Fails the scratch check: it defines ``scratch_marker``."""

                from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


                class ScratchMarkerConnector(KVConnectorBase_V1):
                    def scratch_marker(self) -> None:
                        return None
                '''
            ),
            "tests/audit/test_static.py": _append(
                f"""

                def test_scratch_marker_fails_the_scratch_check() -> None:
                    f = audit(f"{{FIX}}.scratch_marker:ScratchMarkerConnector")
                    assert f["scratch"].status == FAIL
                    assert f["scratch"].spec.clause == "{CHECK_CLAUSE}"
                    assert audit(f"{{FIX}}.mixin_good:MixinConnector")["scratch"].status == PASS
                """
            ),
        },
    ),
    Recipe(
        "Add a driver",
        {
            "kvfail/conformance/scratch_driver.py": lambda old: _new(
                (ROOT / "tests" / "conformance" / "minimal_driver.py").read_text()
            )(old),
            "pyproject.toml": _after(
                r'^\[project\.entry-points\."kvfail\.drivers"\]\n',
                'scratch = "kvfail.conformance.scratch_driver:make_driver"\n',
            ),
        },
        optional=frozenset({"kvfail/conformance/claims.py"}),
    ),
    Recipe(
        "Add a connector",
        {
            "connectors/scratch/__init__.py": _new(
                '''
                """A connector made by following CONTRIBUTING.md's "Add a connector"."""

                from __future__ import annotations

                from vllm.distributed.kv_transfer.kv_connector.v1.base import (
                    KVConnectorBase_V1,
                    SupportsHMA,
                )

                from kvfail import FailureReporterMixin, Stage


                class KvfailScratchWorker(FailureReporterMixin):
                    def __init__(self, num_kv_cache_groups: int) -> None:
                        self.init_failure_reporter(  # step 1
                            num_kv_cache_groups=num_kv_cache_groups, default_deadline_s=30.0
                        )

                    def start_load(self, req_id: str, block_ids: list[int]) -> None:
                        self.track_load(req_id, block_ids, peers=1)  # step 2

                    def on_error(self, req_id: str, reason: str) -> None:
                        self.load_failed(req_id, Stage.PEER, reason, peer="p0")  # step 3

                    def on_done(self, req_id: str) -> None:
                        self.load_succeeded(req_id, peer="p0")

                    def get_transfer_results(self) -> object:
                        return self.transfer_results(finished_sending=set())  # step 4


                class KvfailScratchConnector(KVConnectorBase_V1, SupportsHMA):
                    def __init__(self, num_kv_cache_groups: int = 2) -> None:
                        self.connector_worker = KvfailScratchWorker(num_kv_cache_groups)
                        self.kv_load_deadline_s = 30.0  # step 6

                    def start_load_kv(self, forward_context: object, **kwargs: object) -> None:
                        self.connector_worker.start_load("r1", [1, 2])

                    def get_transfer_results(self, finished_req_ids: set[str]) -> object:
                        return self.connector_worker.get_transfer_results()

                    def get_block_ids_with_load_errors(self) -> set[int]:
                        return self.connector_worker.get_block_ids_with_load_errors()

                    def request_finished_all_groups(
                        self, request: object, block_ids: object
                    ) -> object:
                        return False, None
                '''
            ),
            "connectors/scratch/README.md": _new(
                """
                # `connectors.scratch`

                Where each D-side failure goes: every one is `load_failed`, stage `peer`.
                """
            ),
            "kvfail/audit/inventory.py": _after(
                r"^KVFAIL_CONNECTORS = \(\n",
                '    "connectors.scratch:KvfailScratchConnector",\n',
            ),
        },
    ),
]

#: Gates for what no existing test covers in a scratch tree: the registry and the rows.
SCRATCH_GATES = '''\
"""Written by tests/docs/test_contributing.py into a scratch copy of the tree."""

import importlib

from kvfail.audit.inventory import discover
from kvfail.audit.source import SourceIndex
from kvfail.audit.static import audit_target
from kvfail.conformance.driver import Driver
from kvfail.conformance.resolve import entry_point_modules, spec_problem


def test_the_new_driver_is_registered_under_its_connector_value() -> None:
    assert entry_point_modules()["scratch"] == "kvfail.conformance.scratch_driver"
    assert spec_problem("scratch") is None
    module = importlib.import_module("kvfail.conformance.scratch_driver")
    assert callable(module.make_driver)
    assert any(isinstance(v, type) and issubclass(v, Driver) and v is not Driver
               for v in vars(module).values())


def test_the_new_connector_is_one_of_kvfails_rows_and_breaks_no_must_clause() -> None:
    index = SourceIndex()
    rows = [t for t in discover(index, include_registry=False, include_entry_points=False)
            if t.class_name == "KvfailScratchConnector"]
    assert [t.origin for t in rows] == ["kvfail"]
    assert rows[0].installed, rows[0].notes
    findings = audit_target(rows[0], index)
    assert not [f for f in findings if f.violation == "MUST"], findings
'''


def _guide_sections() -> dict[str, str]:
    text = GUIDE.read_text(encoding="utf-8")
    parts = re.split(r"^## ", text, flags=re.M)
    return {p.split("\n", 1)[0].strip(): p.split("\n", 1)[1] for p in parts[1:]}


def _listed_files(section: str) -> set[str]:
    """The paths in a section's "Files it touches" list (the first backticked path of each
    item; items that name no path, such as "a driver for its transport", add none)."""
    m = re.search(r"Files it touches:\n\n(.*?)\n\n(?!- |  )", section + "\n\n", re.S)
    assert m, "no 'Files it touches:' list"
    paths = set()
    for item in re.split(r"^- ", m.group(1), flags=re.M):
        first = re.search(r"`([\w./<>-]+(?:/|\.py|\.md|\.toml)[\w./<>-]*)`", item)
        if first:
            paths.add(first.group(1))
    return paths


def _matches(pattern: str, path: str) -> bool:
    """``<name>``/``<id>`` stand for any name; a folder stands for any file in it."""
    if pattern.endswith("/"):
        return path.startswith(pattern)
    rx = (
        re.escape(pattern)
        .replace(re.escape("<name>"), r"[a-z_]+")
        .replace(re.escape("<id>"), r"[a-z_]+")
    )
    return re.fullmatch(rx, path) is not None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.section)
def test_each_section_names_exactly_the_files_its_change_touches(recipe: Recipe) -> None:
    listed = _listed_files(_guide_sections()[recipe.section])
    made = set(recipe.edits)
    unlisted = {p for p in made if not any(_matches(pat, p) for pat in listed)}
    assert not unlisted, f"{recipe.section}: the change touches files the guide omits: {unlisted}"
    untouched = {pat for pat in listed - recipe.optional if not any(_matches(pat, p) for p in made)}
    assert not untouched, f"{recipe.section}: the guide names files no change needs: {untouched}"


def _scratch_tree(dest: Path, *, leave_out: frozenset[str] = frozenset()) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv*", "results")
    for top in COPIED:
        shutil.copytree(ROOT / top, dest / top, ignore=ignore)
    for name in COPIED_FILES:
        shutil.copy2(ROOT / name, dest / name)
    for recipe in RECIPES:
        for rel, edit in recipe.edits.items():
            if rel in leave_out:
                continue
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(edit(path.read_text() if path.exists() else None))
    (dest / "tests" / "docs" / "test_scratch_recipes.py").write_text(SCRATCH_GATES)
    return dest


def _installed_entry_points(tree: Path) -> Path:
    """What re-running ``scripts/setup.sh`` gives the scratch tree: its ``pyproject.toml``'s
    entry points as an installed distribution's metadata, on ``PYTHONPATH``."""
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    site = tree.parent / f"{tree.name}-site"
    dist = site / "kvfail_scratch-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvfail-scratch\nVersion: 0\n")
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def _gates(tree: Path, verbosity: str = "-q") -> subprocess.CompletedProcess[str]:
    site = _installed_entry_points(tree)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(site)])}
    argv = [sys.executable, "-m", "pytest", *GATES, verbosity, "-p", "no:randomly"]
    argv += ["-p", "no:cacheprovider", "-o", "addopts=", "-rA"]
    return subprocess.run(
        argv, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_the_recipes_pass_the_gates_in_a_scratch_copy(tmp_path: Path) -> None:
    run = _gates(_scratch_tree(tmp_path / "tree"))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    for gate in ("test_the_new_driver_is_registered", "test_the_new_connector_is_one_of"):
        assert f"PASSED tests/docs/test_scratch_recipes.py::{gate}" in run.stdout, run.stdout


def test_leaving_out_the_contract_step_fails_the_gate_naming_each_new_thing(
    tmp_path: Path,
) -> None:
    run = _gates(_scratch_tree(tmp_path / "tree", leave_out=frozenset({CONTRACT})), "-v")
    assert run.returncode == 1, run.stdout[-6000:]
    gate = "tests/docs/test_contract_doc.py::test_each_clause_lists_what_tests_it"
    for clause, name in (
        (POINT_CLAUSE, "scratch_point"),
        (SCENARIO_CLAUSE, "test_scratch_scenario"),
        (CHECK_CLAUSE, "'scratch'"),
    ):
        assert f"FAILED {gate}[{clause}]" in run.stdout, run.stdout[-6000:]
        report = run.stdout.split(f"test_each_clause_lists_what_tests_it[{clause}] _")[1]
        assert name in report.split("\n_____")[0], f"the {clause} gate did not name {name}"
    assert run.stdout.count("\nFAILED ") == 3, run.stdout[-6000:]  # nothing else broke


def test_leaving_out_the_driver_step_fails_the_fault_gate_naming_the_point(
    tmp_path: Path,
) -> None:
    run = _gates(_scratch_tree(tmp_path / "tree", leave_out=frozenset({POINT_DRIVER})), "-v")
    assert run.returncode == 1, run.stdout[-6000:]
    gate = "test_every_fault_point_is_injected_by_a_driver_and_used_by_a_scenario"
    assert f"FAILED tests/conformance/test_fault_gate.py::{gate}" in run.stdout, run.stdout[-6000:]
    assert "scratch_point: no driver injects it" in run.stdout, run.stdout[-6000:]
    assert run.stdout.count("\nFAILED ") == 1, run.stdout[-6000:]  # nothing else broke
