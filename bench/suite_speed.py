"""How fast the conformance suite is for a connector author's inner loop, against its floor.

Why: an author reruns ``pytest --pyargs kvfail.conformance --connector X`` (the suite as
installed; the checkout's ``conformance/`` adds this project's own self-test) after every
change. Some of its time no connector can save: a deadline scenario must let the declared
deadline pass, a slow peer must be waited for. Each scenario notes those waits
(``wait_floor``, summed in the report as ``floor_s``); everything else (vLLM imports, P
restarts, engine builds, polling) is overhead this bench measures against that floor, in the
same run.

It runs ``pytest --pyargs kvfail.conformance --connector mooncake --policy fail --layout
tp1`` in a child process (a cold start, as the author's is) with a report directory, then
prints the slowest scenarios next to their floors and, on its last line, ``suite_s`` (wall
time of the run), ``suite_floor_s`` and ``suite_overhead_ratio`` (their quotient; target <=
2).
``--fresh-p`` runs the same suite a second time with every P a fresh interpreter
(``KVFAIL_P_ZYGOTE=0``), the way the suite started P before the zygote, and adds
``suite_fresh_p_s`` and ``zygote_speedup``.

Run: ``.venv/bin/python -m bench.suite_speed [--connector mooncake] [--fresh-p]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import figures

#: What each figure must meet (rendered beside it by ``bench.report``).
TARGETS = {"suite_overhead_ratio": "<= 2"}
#: What each figure is measured against in the same run (``bench.report``'s baseline column).
BASELINES = {"suite_s": "suite_floor_s", "suite_scenarios_s": "suite_floor_s"}

ROOT = Path(__file__).resolve().parent.parent


def run_suite(
    connector: str | list[str],
    policy: str,
    layout: str,
    env: dict[str, str],
    *,
    extra: tuple[str, ...] = (),
    target: tuple[str, ...] = ("--pyargs", "kvfail.conformance"),
) -> dict[str, Any]:
    """One cold run of the suite (``target``, by default all of it as installed) for one
    connector or several, with ``extra`` pytest arguments: wall time, exit code and the
    report's records. Shared by the benches that run the suite."""
    connectors = [connector] if isinstance(connector, str) else connector
    with tempfile.TemporaryDirectory(prefix="kvfail-suite-speed-") as out:
        argv = [
            sys.executable,
            "-m",
            "pytest",
            *target,
            *(a for c in connectors for a in ("--connector", c)),
            *extra,
            "--policy",
            policy,
            "--layout",
            layout,
            "--kvfail-report",
            out,
            "-q",
            "-p",
            "no:randomly",
            "-m",
            "not slow",  # what the author's default run selects
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
        ]
        started = time.monotonic()
        proc = subprocess.run(
            argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True
        )
        wall = time.monotonic() - started
        report = Path(out) / "report.json"
        records = json.loads(report.read_text()) if report.exists() else []
    if proc.returncode not in (0, 1):
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"the suite did not run (exit {proc.returncode}):\n{tail}")
    return {"wall_s": wall, "rc": proc.returncode, "records": records}


def floor_of(records: list[dict[str, Any]]) -> float:
    return sum(float(r.get("details", {}).get("floor_s", 0.0)) for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", default="mooncake")
    ap.add_argument("--policy", default="fail")
    ap.add_argument("--layout", default="tp1")
    ap.add_argument("--fresh-p", action="store_true", help="also time it without the zygote")
    args = ap.parse_args()

    run = run_suite(args.connector, args.policy, args.layout, {})
    records = run["records"]
    floor = floor_of(records)
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(f"suite: {args.connector} {args.policy} {args.layout}: exit {run['rc']}, {outcomes}")
    print(f"{'scenario':48}{'s':>8}{'floor s':>9}")
    slowest = sorted(records, key=lambda r: -float(r.get("duration_s", 0.0)))[:12]
    for r in slowest:
        floor_s = float(r.get("details", {}).get("floor_s", 0.0))
        print(f"{r['scenario'][:47]:48}{float(r['duration_s']):>8.2f}{floor_s:>9.2f}")
    values: dict[str, float] = {
        # Inside the scenarios (their own set-up and waits); the rest of suite_s is the
        # run's start (vLLM import, drivers, P start) and the suite's self-test.
        "suite_scenarios_s": round(sum(float(r["duration_s"]) for r in records), 2),
        "suite_s": round(run["wall_s"], 2),
        "suite_floor_s": round(floor, 2),
        "suite_overhead_ratio": round(run["wall_s"] / max(floor, 1e-9), 2),
    }
    if args.fresh_p:
        fresh = run_suite(args.connector, args.policy, args.layout, {"KVFAIL_P_ZYGOTE": "0"})
        values["suite_fresh_p_s"] = round(fresh["wall_s"], 2)
        values["zygote_speedup"] = round(fresh["wall_s"] / max(run["wall_s"], 1e-9), 2)
    print(figures(**values))


if __name__ == "__main__":
    main()
