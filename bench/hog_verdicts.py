"""Verdicts do not depend on the machine's speed: the suite on an idle machine, then with a
CPU hog taking one core for the whole run, and every verdict compared.

Why: a wait that decides a verdict must come from the machine (the suite measures its
contention and scales its waits, noting ``time_scale`` per scenario), never from a
constant tuned on an idle machine. A verdict that flips under load is the suite judging
the machine, not the connector. The idle run is the baseline of the same run.

It runs ``test_scenarios.py`` and ``test_quarantine.py`` at TP 1, both policies, for
kvfail's Mooncake and NIXL connectors and upstream's (``vllm:MooncakeConnector``,
``vllm:NixlConnector``) in one session, twice: idle, then beside a process that spins on
one core. Each verdict that differs is printed before the figures, and so is each failure
of a connector named by ``--must-pass`` (kvfail's own: they must pass under load too).

Run: ``.venv/bin/python -m bench.hog_verdicts [--connector A B ...] [--must-pass A ...]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
from typing import Any

from bench._common import figures
from bench.suite_speed import ROOT, run_suite

#: What each figure must meet (rendered beside it by ``bench.report``).
TARGETS = {"hog_verdicts_changed": "= 0", "hog_must_pass_failed": "= 0"}
#: What each figure is measured against in the same run.
BASELINES = {"hog_suite_s": "idle_suite_s"}

SCENARIOS = ROOT / "kvfail" / "conformance" / "scenarios"


def _spin() -> None:
    while True:
        pass


def verdicts(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], str]:
    return {(r["connector"], r["scenario"], r["policy"]): r["outcome"] for r in records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--connector",
        nargs="+",
        default=["mooncake", "vllm:MooncakeConnector", "nixl", "vllm:NixlConnector"],
    )
    ap.add_argument(
        "--must-pass",
        nargs="*",
        default=["mooncake", "nixl"],
        help="connectors that must have no failure in either run (default: kvfail's own)",
    )
    ap.add_argument("--policy", default="both")
    args = ap.parse_args()
    target = (str(SCENARIOS / "test_scenarios.py"), str(SCENARIOS / "test_quarantine.py"))

    idle = run_suite(args.connector, args.policy, "tp1", {}, target=target)
    hog = multiprocessing.Process(target=_spin, daemon=True)
    hog.start()
    try:
        loaded = run_suite(args.connector, args.policy, "tp1", {}, target=target)
    finally:
        hog.terminate()
        hog.join(10)
    before, after = verdicts(idle["records"]), verdicts(loaded["records"])
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for key in changed:
        print("CHANGED", *key, before.get(key), "->", after.get(key))
    # Skips are the layouts and faults this run does not cover, named by the suite.
    must_pass = set(args.must_pass)
    ours = [
        (run, key)
        for run, verdict in (("idle", before), ("under load", after))
        for key, outcome in verdict.items()
        if key[0] in must_pass and outcome in ("failed", "error")
    ]
    for run, key in ours:
        print(f"FAILED {run}", *key, (before if run == "idle" else after)[key])
    scales = [float(r.get("details", {}).get("time_scale", 1.0)) for r in loaded["records"]]
    print(
        figures(
            hog_verdicts=len(after),
            hog_verdicts_changed=len(changed),
            hog_must_pass_failed=len(ours),
            idle_suite_s=round(idle["wall_s"], 1),
            hog_suite_s=round(loaded["wall_s"], 1),
            hog_time_scale_max=round(max(scales, default=1.0), 2),
        )
    )


if __name__ == "__main__":
    main()
