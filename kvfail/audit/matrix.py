"""``kvfail matrix``: the audit of every connector on every built vLLM, in one table.

Why a command of its own: a connector package supports several vLLM releases, and a
reader wants to see when a connector started (or stopped) honouring a clause. Each vLLM
lives in its own venv (``scripts/setup.sh --vllm VERSION`` builds ``.venv-VERSION/``;
the default is ``.venv/``), and one interpreter can import only one vLLM, so the matrix
runs ``kvfail audit --format json`` in a child of each venv's Python (the same code as
``kvfail audit``; ``--quick`` unless ``--dynamic``) and joins the rows here.

A release no venv here can hold (vLLM 0.33.0 ships for CUDA only) joins as a static column
from its wheel: ``pip download --no-deps vllm==0.33.0 -d DIR``, then ``kvfail matrix
--wheel DIR/vllm-0.33.0-*.whl`` (:mod:`kvfail.audit.wheel`: the sources are unpacked and
read, never installed or imported; the dynamic tier is not run for it).

This module imports no vLLM; it reads each venv's installed version from its package
metadata, never by importing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvfail.audit.wheel import dist_version, unpack_sources
from kvfail.compat import MISSING_FEATURE_MARK

__all__ = [
    "Cell",
    "Matrix",
    "Venv",
    "VersionRun",
    "add_parser",
    "build",
    "discover_venvs",
    "render_heatmap",
    "render_table",
    "run",
]

#: A child that has not answered in this long is stopped (the dynamic tier has its own
#: budget, ``--budget-s``; this only bounds a hung child).
_STATIC_TIMEOUT_S = 600.0
_DYNAMIC_SLACK_S = 180.0


@dataclass(frozen=True)
class Venv:
    """One built venv and the vLLM installed in it."""

    version: str
    python: Path
    #: Sources unpacked from a wheel that cannot be installed here
    #: (:mod:`kvfail.audit.wheel`): first on the child's ``PYTHONPATH``, static tier only.
    source: Path | None = None

    @property
    def key(self) -> tuple[int, ...]:
        return _version_key(self.version)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def venv_vllm_version(venv: Path) -> str | None:
    """The vLLM version installed in ``venv``, from its dist-info (no import)."""
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for entry in site.iterdir():
            version = dist_version(entry.name)
            if version:
                return version
    return None


def discover_venvs(root: Path, wanted: Sequence[str] = ()) -> list[Venv]:
    """``.venv`` and every ``.venv-*`` under ``root`` with a vLLM, oldest version first;
    ``wanted`` keeps only those versions (an unknown one is an error naming what exists)."""
    found: dict[str, Venv] = {}
    for path in sorted(root.glob(".venv*")):
        python = path / "bin" / "python"
        if not python.exists():
            continue
        version = venv_vllm_version(path)
        if version is None:
            continue
        # The default .venv wins a tie with a .venv-VERSION of the same release.
        if version not in found or path.name == ".venv":
            found[version] = Venv(version, python)
    if wanted:
        missing = [v for v in wanted if v not in found]
        if missing:
            have = ", ".join(sorted(found, key=_version_key)) or "none"
            raise SystemExit(
                f"kvfail matrix: no venv with vLLM {', '.join(missing)} under {root} "
                f"(built: {have}); build one with scripts/setup.sh --vllm VERSION"
            )
        found = {v: found[v] for v in wanted}
    return sorted(found.values(), key=lambda v: v.key)


@dataclass
class Cell:
    """One connector on one vLLM: its static verdict and, if run, its dynamic one."""

    present: bool = True
    static_fail: list[str] = field(default_factory=list)
    static_unknown: list[str] = field(default_factory=list)
    static_checked: int = 0
    #: (failed, run, not run) scenarios, or None when the dynamic tier did not run it.
    dynamic: tuple[int, int, int] | None = None
    #: Scenarios that ended in a :class:`kvfail.compat.MissingFeatureError`: the tool
    #: could not judge them on this vLLM (not among ``dynamic``'s counts).
    dynamic_errors: int = 0
    #: Each failed (or unjudged) dynamic scenario and the audit's summary of it.
    dynamic_failures: dict[str, str] = field(default_factory=dict)
    #: MUST/SHOULD levels of the failed static checks, by check id.
    levels: dict[str, str] = field(default_factory=dict)
    #: The audit's coverage of the row (``driver``, ``not_applicable``, ``blocked``,
    #: ``driver_not_built``, ``not_run``, ``unknown``) and its reason: why a row without
    #: dynamic verdicts has none (None in results saved before it was recorded).
    coverage: str | None = None
    coverage_reason: str = ""

    @property
    def static_text(self) -> str:
        if not self.present:
            return "absent"
        if self.static_fail:
            return "FAIL " + ",".join(self.static_fail)
        if self.static_unknown:
            return "? " + ",".join(self.static_unknown)
        return "ok"

    @property
    def dynamic_text(self) -> str:
        """The audit's own dynamic cell: ``ok n/n``, ``FAIL k/n``, ``+k not run``."""
        if self.dynamic is None or not self.present:
            return "-"
        bad, ran, not_run = self.dynamic
        if not ran:
            # Every scenario an error (kvfail's NIXL refusing a vLLM without the failed
            # set): say so, not "-", which reads as "no driver".
            parts = [f"+{self.dynamic_errors} error"] if self.dynamic_errors else []
            parts += [f"? {not_run} not run"] if not_run else []
            return " ".join(parts) or "-"
        text = f"FAIL {bad}/{ran}" if bad else f"ok {ran}/{ran}"
        if self.dynamic_errors:
            text += f" +{self.dynamic_errors} error"
        return f"{text} +{not_run} not run" if not_run else text

    def text(self, dynamic: bool) -> str:
        return f"{self.static_text} ; {self.dynamic_text}" if dynamic else self.static_text


@dataclass
class VersionRun:
    """What one venv's audit child produced (or why it produced nothing)."""

    version: str
    python: str
    elapsed_s: float
    error: str | None = None
    dynamic_incomplete: str | None = None
    cells: dict[str, Cell] = field(default_factory=dict)
    #: :func:`kvfail.compat.features` in that venv: why a clause can read differently.
    features: dict[str, bool] | None = None
    #: The audit's ``dynamic_tier``: ``ran``, or why not (``skipped (--quick)``).
    dynamic_tier: str | None = None


@dataclass
class Matrix:
    dynamic: bool
    runs: list[VersionRun]

    @property
    def versions(self) -> list[str]:
        return [r.version for r in self.runs]

    @property
    def connectors(self) -> list[str]:
        """Every connector seen on any version, in the newest version's order first."""
        out: list[str] = []
        for run_ in reversed(self.runs):
            out += [c for c in run_.cells if c not in out]
        return out

    def cell(self, connector: str, version: str) -> Cell:
        for run_ in self.runs:
            if run_.version == version:
                return run_.cells.get(connector, Cell(present=False))
        return Cell(present=False)

    def to_json(self) -> dict[str, Any]:
        return {"dynamic": self.dynamic, "runs": [asdict(r) for r in self.runs]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Matrix:
        runs = []
        for r in data["runs"]:
            cells = {}
            for name, c in r.pop("cells").items():
                dyn = c.pop("dynamic")
                cells[name] = Cell(**c, dynamic=None if dyn is None else tuple(dyn))
            runs.append(VersionRun(**r, cells=cells))
        return cls(dynamic=bool(data["dynamic"]), runs=runs)

    def merged(self, other: Matrix) -> Matrix:
        """This matrix with ``other``'s runs added; on a shared version, ``other``'s cells
        win connector by connector (separate runs of a few connectors each add up)."""
        runs = {r.version: r for r in self.runs}
        for r in other.runs:
            old = runs.get(r.version)
            if old is None or old.error:
                runs[r.version] = r
                continue
            cells = {**old.cells, **r.cells}
            for name, cell in r.cells.items():
                before = old.cells.get(name)
                if cell.dynamic is None and before is not None and before.dynamic is not None:
                    # A later static-only run refreshes the static verdict, keeps the
                    # dynamic one.
                    cells[name] = dataclasses.replace(
                        cell,
                        dynamic=before.dynamic,
                        dynamic_errors=before.dynamic_errors,
                        dynamic_failures=before.dynamic_failures,
                    )
            runs[r.version] = dataclasses.replace(
                r,
                cells=cells,
                elapsed_s=old.elapsed_s + r.elapsed_s,
                error=r.error if not r.cells else None,
                features=r.features or old.features,
                dynamic_tier=(
                    "ran"
                    if "ran" in (old.dynamic_tier, r.dynamic_tier)
                    else r.dynamic_tier or old.dynamic_tier
                ),
                dynamic_incomplete="; ".join(
                    x for x in (old.dynamic_incomplete, r.dynamic_incomplete) if x
                )
                or None,
            )
        ordered = sorted(runs.values(), key=lambda r: _version_key(r.version))
        return Matrix(dynamic=self.dynamic or other.dynamic, runs=ordered)


def cells_from_audit(report: dict[str, Any]) -> dict[str, Cell]:
    """The cells of one ``kvfail audit --format json`` report, one per connector row."""
    cells: dict[str, Cell] = {}
    for row in report.get("connectors", []):
        if not row.get("installed", True):
            cells[row["name"]] = Cell(present=False)
            continue
        coverage = row.get("coverage") or {}
        cell = Cell(coverage=coverage.get("kind"), coverage_reason=coverage.get("reason", ""))
        bad = ran = not_run = errors = 0
        any_dynamic = False
        for f in row.get("findings", []):
            status = f.get("status")
            if f.get("tier") == "DYNAMIC":
                any_dynamic = True
                gap = status in ("fail", "unknown") and MISSING_FEATURE_MARK in json.dumps(f)
                if status == "fail" or gap:
                    cell.dynamic_failures[f["check"]] = str(f.get("summary", ""))[:400]
                if gap:  # a harness error: the audit keeps it unknown (older: failed)
                    errors += 1
                elif status == "fail":
                    bad += 1
                    ran += 1
                elif status == "pass":
                    ran += 1
                elif status == "unknown":
                    not_run += 1
                continue
            if status == "n/a":
                continue
            cell.static_checked += 1
            if status == "fail":
                cell.static_fail.append(f["check"])
                cell.levels[f["check"]] = f.get("level", "")
            elif status == "unknown":
                cell.static_unknown.append(f["check"])
        if any_dynamic:
            cell.dynamic = (bad, ran, not_run)
            cell.dynamic_errors = errors
        cells[row["name"]] = cell
    return cells


def audit_command(
    python: Path | str,
    output: Path,
    *,
    dynamic: bool,
    connectors: Iterable[str] = (),
    budget_s: float | None = None,
    policy: str | None = None,
    layouts: Iterable[str] = (),
) -> list[str]:
    """The child's command line: ``kvfail audit`` in that venv, JSON to ``output``."""
    cmd = [str(python), "-m", "kvfail.cli", "audit", "--format", "json", "--fail-on", "never"]
    cmd += ["--no-progress", "--output", str(output)]
    if not dynamic:
        cmd.append("--quick")
    for c in connectors:
        cmd += ["--connector", c]
    if dynamic and budget_s is not None:
        cmd += ["--budget-s", f"{budget_s:g}"]
    if dynamic and policy:
        cmd += ["--policy", policy]
    for layout in layouts:
        cmd += ["--layout", layout]
    return cmd


_FEATURES_CODE = "import json; from kvfail import compat; print(json.dumps(compat.features()))"


def venv_features(python: Path | str, cwd: Path | None = None) -> dict[str, bool] | None:
    """What :mod:`kvfail.compat` detects in that venv (None if the child fails)."""
    try:
        proc = subprocess.run(
            [str(python), "-c", _FEATURES_CODE],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_STATIC_TIMEOUT_S,
            check=False,
        )
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def run_version(
    venv: Venv,
    *,
    dynamic: bool,
    connectors: Sequence[str] = (),
    budget_s: float | None = None,
    policy: str | None = None,
    layouts: Sequence[str] = (),
    cwd: Path | None = None,
    log: TextIO | None = None,
) -> VersionRun:
    """Audit one venv in a child of its own Python; a failed child is an error row,
    never a verdict about the connectors. A wheel's sources (``venv.source``) get the
    static tier only: nothing of theirs may run."""
    start = time.monotonic()
    wheel_only = venv.source is not None
    dynamic = dynamic and not wheel_only
    with tempfile.TemporaryDirectory(prefix="kvfail-matrix-") as tmp:
        out = Path(tmp) / "audit.json"
        cmd = audit_command(
            venv.python,
            out,
            dynamic=dynamic,
            connectors=connectors,
            budget_s=budget_s,
            policy=policy,
            layouts=layouts,
        )
        limit = _STATIC_TIMEOUT_S
        if dynamic:
            limit = (budget_s or 3600.0) + _DYNAMIC_SLACK_S
        env = child_env(venv, cwd)
        try:
            proc = subprocess.run(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=limit,
                check=False,
            )
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


def child_env(venv: Venv, cwd: Path | None) -> dict[str, str]:
    """The audit child's environment: this one, without an activated venv; a wheel's
    sources first on ``PYTHONPATH``, then the checkout (so kvfail is this one)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    if venv.source is not None:
        paths = [str(venv.source), str(cwd or Path.cwd()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def build(
    venvs: Sequence[Venv],
    *,
    dynamic: bool,
    connectors: Sequence[str] = (),
    budget_s: float | None = None,
    policy: str | None = None,
    layouts: Sequence[str] = (),
    cwd: Path | None = None,
    log: TextIO | None = None,
) -> Matrix:
    """Run the audit in every venv, one after the other (each child uses the machine)."""
    runs = []
    for venv in venvs:
        if log is not None:
            tier = "static + dynamic" if dynamic else "static"
            log.write(f"kvfail matrix: vLLM {venv.version} ({tier}) via {venv.python}\n")
            log.flush()
        runs.append(
            run_version(
                venv,
                dynamic=dynamic,
                connectors=connectors,
                budget_s=budget_s,
                policy=policy,
                layouts=layouts,
                cwd=cwd,
                log=log,
            )
        )
        if log is not None:
            last = runs[-1]
            status = last.error or f"{len(last.cells)} connectors"
            log.write(f"kvfail matrix: vLLM {venv.version}: {status} in {last.elapsed_s:.0f} s\n")
            log.flush()
    return Matrix(dynamic=dynamic, runs=runs)


# ------------------------------------------------------------------ rendering


def _rows(matrix: Matrix) -> tuple[list[str], list[list[str]]]:
    header = ["connector", *[f"vLLM {v}" for v in matrix.versions]]
    body = [
        [name, *[matrix.cell(name, v).text(matrix.dynamic) for v in matrix.versions]]
        for name in matrix.connectors
    ]
    return header, body


def render_table(matrix: Matrix, fmt: str = "table") -> str:
    """The connector x version table: text (``table``), ``markdown`` or ``json``."""
    if fmt == "json":
        return json.dumps(matrix.to_json(), indent=2)
    header, body = _rows(matrix)
    lines: list[str] = []
    if fmt == "markdown":
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += [
            "| " + " | ".join(f"`{c}`" if i else c for i, c in enumerate(r)) + " |" for r in body
        ]
    else:
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body
        ]
    lines.append("")
    lines.append(
        "cell: static checks failed (ids as in `kvfail audit`; ok = none)"
        + (
            " ; dynamic scenarios (ok n/n, FAIL k/n; +k error: the tool could not judge them"
            " on that vLLM, a missing feature; - = no driver)"
            if matrix.dynamic
            else ""
        )
        + "; absent = not in that vLLM"
    )
    for r in matrix.runs:
        if r.features is not None:
            have = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in r.features.items())
            lines.append(f"vLLM {r.version} features: {have}")
    for r in matrix.runs:
        if r.error:
            lines.append(f"vLLM {r.version}: ERROR {r.error}")
        elif r.dynamic_incomplete:
            lines.append(f"vLLM {r.version}: dynamic tier incomplete: {r.dynamic_incomplete}")
    return "\n".join(lines) + "\n"


def render_heatmap(matrix: Matrix, path: Path) -> None:
    """Draw the matrix as a PNG (:mod:`kvfail.audit.heatmap`: one colour per verdict)."""
    from kvfail.audit.heatmap import render

    render(matrix, path)


# ------------------------------------------------------------------ command line


def add_parser(subparsers: Any) -> None:
    """Register ``matrix`` on the ``kvfail`` command's subparsers."""
    p = subparsers.add_parser(
        "matrix",
        help="the audit of every connector on every built vLLM (one venv per version)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dynamic", action="store_true", help="also run the dynamic tier")
    p.add_argument(
        "--vllm",
        action="append",
        default=[],
        metavar="VERSION",
        help="only this vLLM version (repeatable; default: every built venv)",
    )
    p.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="NAME",
        help="audit only these connectors (as `kvfail audit --connector`, repeatable)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="S",
        help="the dynamic tier's budget per version (`kvfail audit --budget-s`)",
    )
    p.add_argument("--policy", choices=["fail", "recompute", "both"], default=None)
    p.add_argument("--layout", action="append", default=[], metavar="L")
    p.add_argument("--format", choices=["table", "markdown", "json"], default="table", dest="fmt")
    p.add_argument("--output", "-o", type=Path, help="write the table here instead of stdout")
    p.add_argument("--heatmap", type=Path, metavar="PNG", help="also draw the table as a PNG")
    p.add_argument(
        "--save", type=Path, metavar="JSON", help="save the results (for --load and re-drawing)"
    )
    p.add_argument(
        "--load",
        type=Path,
        action="append",
        default=[],
        metavar="JSON",
        help="start from saved results (repeatable, later files win a version); with no "
        "--vllm only the loaded versions are shown, nothing is run",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="where the venvs are (default: the kvfail checkout)",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=[],
        metavar="WHL",
        help="also audit this vLLM wheel's connectors, static tier only, from its unpacked "
        "sources (never installed or imported; e.g. one for an accelerator this machine "
        "lacks, from `pip download --no-deps vllm==VERSION`); repeatable",
    )


def _default_root() -> Path:
    return Path(__file__).resolve().parents[2]


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvfail-wheels-") as tmp:
        return _run(args, _unpacked_wheels(getattr(args, "wheel", []), Path(tmp)))


def _unpacked_wheels(wheels: Sequence[Path], into: Path) -> list[Venv]:
    """Each wheel's sources, as a row the static tier reads with this Python."""
    rows = []
    for i, wheel in enumerate(wheels):
        try:
            version = unpack_sources(wheel, into / str(i))
        except ValueError as exc:
            raise SystemExit(f"kvfail matrix: --wheel {exc}") from None
        rows.append(Venv(version, Path(sys.executable), source=into / str(i)))
    return rows


def _run(args: argparse.Namespace, wheels: list[Venv]) -> int:
    root = (args.root or _default_root()).resolve()
    matrix = Matrix(dynamic=args.dynamic, runs=[])
    for path in args.load:
        matrix = matrix.merged(Matrix.from_json(json.loads(path.read_text())))
    from_wheels = {w.version for w in wheels}
    wanted = [v for v in args.vllm if v not in from_wheels]
    if wheels or not args.load or args.vllm:
        venvs = [] if args.vllm and not wanted else discover_venvs(root, wanted)
        venvs = sorted([*venvs, *wheels], key=lambda v: v.key)
        if not venvs:
            print(
                f"kvfail matrix: no venv with vLLM under {root}; run scripts/setup.sh",
                file=sys.stderr,
            )
            return 2
        fresh = build(
            venvs,
            dynamic=args.dynamic,
            connectors=args.connector,
            budget_s=args.budget_s,
            policy=args.policy,
            layouts=args.layout,
            cwd=root,
            log=sys.stderr,
        )
        matrix = matrix.merged(fresh)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(matrix.to_json(), indent=2) + "\n")
    text = render_table(matrix, args.fmt)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    if args.heatmap:
        render_heatmap(matrix, args.heatmap)
        print(f"kvfail matrix: heat map written to {args.heatmap}", file=sys.stderr)
    return 1 if any(r.error for r in matrix.runs) else 0
