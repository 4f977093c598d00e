"""A failure burst: 10,000 loads in flight, 5,000 fail at once from 8 threads.

Measures the one drain that delivers the burst (the step that pays for it), the peak
memory of a round, and whether memory stays flat over many rounds (it must: state is
per in-flight load and released at the drain). Target: burst_drain_ms <= 5.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
import tracemalloc

import psutil

from bench._common import KvfailWorker, figures, quiet
from kvfail import Stage

#: What each figure must meet (rendered beside it by ``bench.report``).
TARGETS = {"burst_drain_ms": "<= 5", "burst_rss_growth_kib": "flat"}


def one_round(w: KvfailWorker, n: int, fail: int, threads: int) -> float:
    for i in range(n):
        w.track_load(f"r{i}", [2 * i, 2 * i + 1])
    failing = [f"r{i}" for i in range(0, 2 * fail, 2)]
    chunks = [failing[k::threads] for k in range(threads)]

    def report(ids: list[str]) -> None:
        for req in ids:
            w.load_failed(req, Stage.TRANSFER, "burst")

    pool = [threading.Thread(target=report, args=(c,)) for c in chunks]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    t0 = time.perf_counter()
    report_ = w.drain_step()
    invalid = w.get_block_ids_with_load_errors()
    drain_ms = (time.perf_counter() - t0) * 1e3
    assert len(report_.finished_recving) == fail and len(invalid) == 2 * fail
    for i in range(1, 2 * fail, 2):  # the other half succeed, then the rest
        w.load_succeeded(f"r{i}")
    for i in range(2 * fail, n):
        w.load_succeeded(f"r{i}")
    w.drain_step()
    assert len(w.failure_reporter) == 0
    return drain_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--in-flight", type=int, default=10_000)
    ap.add_argument("--failing", type=int, default=5_000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    quiet()
    w = KvfailWorker()
    proc = psutil.Process()

    gc.collect()
    tracemalloc.start()
    one_round(w, args.in_flight, args.failing, args.threads)
    peak_kib = tracemalloc.get_traced_memory()[1] / 1024
    tracemalloc.stop()

    drains: list[float] = []
    rss: list[float] = []
    for _ in range(args.rounds):
        drains.append(one_round(w, args.in_flight, args.failing, args.threads))
        gc.collect()
        rss.append(proc.memory_info().rss / 1024)
    settle = min(10, len(rss) - 1)
    growth_kib = rss[-1] - rss[settle]
    print(
        f"rounds={args.rounds} in_flight={args.in_flight} failing={args.failing} "
        f"threads={args.threads}"
    )
    print(f"drain ms: median {statistics.median(drains):.2f}, max {max(drains):.2f}")
    print(
        f"rss KiB after round {settle + 1}: {rss[settle]:.0f}, after round {len(rss)}: "
        f"{rss[-1]:.0f}"
    )
    print(
        figures(
            burst_drain_ms=statistics.median(drains),
            burst_drain_max_ms=max(drains),
            burst_peak_kib=peak_kib,
            burst_rss_growth_kib=growth_kib,
        )
    )


if __name__ == "__main__":
    main()
