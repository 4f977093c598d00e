"""The soak over many seeds: kvfail's connectors pass every fault plan, and a control that
loses concurrent failures is caught on every one.

Why: one seed is one fault plan. A bug that shows only for some interleaving of
successes, failures and aborts passes a single-seed CI run by luck; many seeds make that
luck unlikely. The control (``ReportsOneFailurePerStep``, the toy losing every failure of
a step but the first) is the baseline of the same run: a seed on which it passes is a
plan too thin to judge anything, and is counted as such.

Each seed runs ``test_soak_random_faults`` for every connector in one child pytest
(``--kvfail-seed N -k soak``), so a failing seed replays with that command alone; the
failing ``connector seed policy`` triples are printed before the figures.

Run: ``.venv/bin/python -m bench.soak_seeds [--seeds 20] [--connector toy mooncake nixl]``.
"""

from __future__ import annotations

import argparse

from bench._common import figures
from bench.suite_speed import run_suite

#: What each figure must meet (rendered beside it by ``bench.report``).
TARGETS = {"soak_failures": "= 0", "soak_control_missed": "= 0"}
#: What each figure is measured against in the same run.
BASELINES = {"soak_failures": "soak_control_caught"}

CONTROL = "kvfail.conformance.negative:ReportsOneFailurePerStep"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--connector", nargs="+", default=["toy", "mooncake", "nixl"])
    ap.add_argument("--policy", default="both")
    args = ap.parse_args()

    failures: list[str] = []
    caught = missed = runs = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run = run_suite(
            [*args.connector, CONTROL],
            args.policy,
            "tp1",
            {},
            extra=("--kvfail-seed", str(seed), "-k", "soak"),
        )
        for r in run["records"]:
            if r["scenario"] != "test_soak_random_faults":
                continue
            if r["connector"] == CONTROL:
                caught += r["outcome"] == "failed"
                missed += r["outcome"] != "failed"
                continue
            runs += 1
            if r["outcome"] != "passed":
                failures.append(f"{r['connector']} seed {seed} {r['policy']}: {r['outcome']}")
        print(f"seed {seed}: {len(failures)} failing so far, control caught {caught}")
    for line in failures:
        print("FAILED", line)
    print(
        figures(
            soak_seeds=args.seeds,
            soak_runs=runs,
            soak_failures=len(failures),
            soak_control_caught=caught,
            soak_control_missed=missed,
        )
    )


if __name__ == "__main__":
    main()
