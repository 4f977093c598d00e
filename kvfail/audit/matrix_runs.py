"""Running ``kvfail audit`` in a child of each venv's Python, for ``kvfail matrix``.

Why a child per venv: one interpreter can import only one vLLM, so the matrix runs
``kvfail audit --format json`` (the same code as ``kvfail audit``; ``--quick`` unless
``--dynamic``) in each venv and joins the reports into one :class:`Matrix`. A child that
fails is an error row, never a verdict about the connectors.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from kvfail.audit.matrix_table import Matrix, VersionRun, cells_from_audit
from kvfail.audit.venvs import Venv, child_env

__all__ = ["audit_command", "build", "run_version", "venv_features"]

#: A child that has not answered in this long is stopped (the dynamic tier has its own
#: budget, ``--budget-s``; this only bounds a hung child).
_STATIC_TIMEOUT_S = 600.0
_DYNAMIC_SLACK_S = 180.0


@dataclass(frozen=True)
class AuditOptions:
    """What each venv's audit child is asked to do: one value from ``kvfail matrix``'s
    options down to the child's command line."""

    dynamic: bool
    connectors: Sequence[str] = ()
    budget_s: float | None = None
    policy: str | None = None
    layouts: Sequence[str] = ()


def audit_command(python: Path | str, output: Path, options: AuditOptions) -> list[str]:
    """The child's command line: ``kvfail audit`` in that venv, JSON to ``output``."""
    cmd = [str(python), "-m", "kvfail.cli", "audit", "--format", "json", "--fail-on", "never"]
    cmd += ["--no-progress", "--output", str(output)]
    if not options.dynamic:
        cmd.append("--quick")
    for c in options.connectors:
        cmd += ["--connector", c]
    if options.dynamic and options.budget_s is not None:
        cmd += ["--budget-s", f"{options.budget_s:g}"]
    if options.dynamic and options.policy:
        cmd += ["--policy", options.policy]
    for layout in options.layouts:
        cmd += ["--layout", layout]
    return cmd


def _run_child(
    cmd: list[str], cwd: Path | None, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Every matrix child alike: it never reads our stdin, its output comes back as text,
    and a hung one raises ``TimeoutExpired``; its exit status is the caller's to judge."""
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


_FEATURES_CODE = "import json; from kvfail import compat; print(json.dumps(compat.features()))"


def venv_features(python: Path | str, cwd: Path | None = None) -> dict[str, bool] | None:
    """What :mod:`kvfail.compat` detects in that venv (None if the child fails)."""
    try:
        proc = _run_child([str(python), "-c", _FEATURES_CODE], cwd, _STATIC_TIMEOUT_S)
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def run_version(
    venv: Venv,
    options: AuditOptions,
    *,
    cwd: Path | None = None,
    log: TextIO | None = None,
) -> VersionRun:
    """Audit one venv in a child of its own Python; a failed child is an error row,
    never a verdict about the connectors. A wheel's sources (``venv.source``) get the
    static tier only: nothing of theirs may run."""
    start = time.monotonic()
    wheel_only = venv.source is not None
    if wheel_only:
        options = replace(options, dynamic=False)
    with tempfile.TemporaryDirectory(prefix="kvfail-matrix-") as tmp:
        out = Path(tmp) / "audit.json"
        cmd = audit_command(venv.python, out, options)
        limit = _STATIC_TIMEOUT_S
        if options.dynamic:
            limit = (options.budget_s or 3600.0) + _DYNAMIC_SLACK_S
        env = child_env(venv, cwd)
        try:
            proc = _run_child(cmd, cwd, limit, env)
        except subprocess.TimeoutExpired:
            return VersionRun(
                venv.version,
                str(venv.python),
                time.monotonic() - start,
                error=f"audit child did not finish within {limit:g} s",
            )
        elapsed = time.monotonic() - start
        if log is not None and proc.stderr:
            for line in proc.stderr.splitlines():
                if line.startswith(("dynamic tier", "kvfail audit")):
                    log.write(f"  [{venv.version}] {line}\n")
        if not out.exists():
            tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
            return VersionRun(
                venv.version,
                str(venv.python),
                elapsed,
                error=f"audit child exited {proc.returncode} without a report: {tail[-400:]}",
            )
        report = json.loads(out.read_text())
    return VersionRun(
        venv.version,
        str(venv.python),
        elapsed,
        dynamic_incomplete=(
            "static tier only: read from the wheel's sources, not installed"
            if wheel_only
            else report.get("dynamic_incomplete")
        ),
        cells=cells_from_audit(report),
        # compat would import vLLM: the venv's own, which is not the wheel's.
        features=None if wheel_only else venv_features(venv.python, cwd),
        dynamic_tier=report.get("dynamic_tier"),
    )


def build(
    venvs: Sequence[Venv],
    options: AuditOptions,
    *,
    cwd: Path | None = None,
    log: TextIO | None = None,
) -> Matrix:
    """Run the audit in every venv, one after the other (each child uses the machine)."""
    runs = []
    for venv in venvs:
        if log is not None:
            tier = "static + dynamic" if options.dynamic else "static"
            log.write(f"kvfail matrix: vLLM {venv.version} ({tier}) via {venv.python}\n")
            log.flush()
        runs.append(run_version(venv, options, cwd=cwd, log=log))
        if log is not None:
            last = runs[-1]
            status = last.error or f"{len(last.cells)} connectors"
            log.write(f"kvfail matrix: vLLM {venv.version}: {status} in {last.elapsed_s:.0f} s\n")
            log.flush()
    return Matrix(dynamic=options.dynamic, runs=runs)
