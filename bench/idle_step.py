"""Per-step cost of draining both failure channels when nothing failed.

This is the cost every engine step pays forever, so it must be negligible. Both sides run
in the same process, interleaved, best of several repeats. Target: idle_ratio >= 3.
"""

from __future__ import annotations

import argparse
import timeit

from bench._common import KvfailWorker, UpstreamStyleWorker, figures, quiet

#: What each figure must meet (rendered beside it by ``bench.report``).
TARGETS = {"idle_ratio": ">= 3"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--loops", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--in-flight", type=int, default=256, help="tracked loads with deadlines")
    args = ap.parse_args()
    quiet()
    ours = KvfailWorker(deadline_s=3600.0)
    for i in range(args.in_flight):  # a realistic idle step: loads in flight, none settled
        ours.track_load(f"r{i}", [i])
    base = UpstreamStyleWorker()
    t_base = t_ours = float("inf")
    for _ in range(args.repeats):
        t_base = min(t_base, timeit.timeit(base.step, number=args.loops))
        t_ours = min(t_ours, timeit.timeit(ours.step, number=args.loops))
    base_ns, ours_ns = t_base / args.loops * 1e9, t_ours / args.loops * 1e9
    print(f"{'':24}{'ns/step':>10}")
    print(f"{'queue.Queue baseline':24}{base_ns:>10.0f}")
    print(f"{'kvfail drain':24}{ours_ns:>10.0f}")
    print(figures(idle_baseline_ns=base_ns, idle_kvfail_ns=ours_ns, idle_ratio=base_ns / ours_ns))


if __name__ == "__main__":
    main()
