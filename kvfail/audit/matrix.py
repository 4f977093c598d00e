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
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvfail.audit import add_command
from kvfail.audit.matrix_render import render_heatmap, render_table
from kvfail.audit.matrix_runs import AuditOptions, build
from kvfail.audit.matrix_table import Matrix
from kvfail.audit.venvs import Venv, discover_venvs, unpacked_wheels

__all__ = ["add_parser", "portable", "run"]


def add_parser(subparsers: Any) -> None:
    """Register ``matrix`` on the ``kvfail`` command's subparsers."""
    p = add_command(
        subparsers,
        "matrix",
        __doc__,
        "the audit of every connector on every built vLLM (one venv per version)",
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


def portable(text: str, root: Path) -> str:
    """``text`` with the checkout's absolute paths made relative to it.

    Why: saved results and tables are committed (``docs/vllm-versions.json``), and a
    venv's interpreter or a traceback in a failure's summary names this machine's
    folders, which mean nothing to a reader. A venv that is a link to another checkout's
    is named by its link."""
    prefixes = {str(link.resolve()): link.name for link in root.glob(".venv*") if link.is_symlink()}
    prefixes[str(root)] = "."
    for absolute, relative in sorted(prefixes.items(), key=lambda p: -len(p[0])):
        text = text.replace(absolute + os.sep, "" if relative == "." else relative + os.sep)
    return text


def _default_root() -> Path:
    return Path(__file__).resolve().parents[2]


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvfail-wheels-") as tmp:
        return _run(args, unpacked_wheels(getattr(args, "wheel", []), Path(tmp)))


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
        options = AuditOptions(
            dynamic=args.dynamic,
            connectors=args.connector or (),
            budget_s=args.budget_s,
            policy=args.policy,
            layouts=args.layout or (),
        )
        fresh = build(venvs, options, cwd=root, log=sys.stderr)
        matrix = matrix.merged(fresh)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(portable(json.dumps(matrix.to_json(), indent=2), root) + "\n")
    text = render_table(matrix, args.fmt)
    if args.output:
        args.output.write_text(portable(text, root))
    else:
        sys.stdout.write(text)
    if args.heatmap:
        render_heatmap(matrix, args.heatmap)
        print(f"kvfail matrix: heat map written to {args.heatmap}", file=sys.stderr)
    return 1 if any(r.error for r in matrix.runs) else 0
