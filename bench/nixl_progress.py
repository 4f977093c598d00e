"""CPU an idle NIXL agent costs: NIXL's busy-spinning progress thread vs the rig's delay.

Why it matters here: on a small CPU rig every agent (each P, each D engine, each TP rank)
is a process-long poller; see ``kvfail.rig.nixl_progress``. Each side runs in its own child
process (a real agent over UCX TCP on loopback, nothing else), interleaved, and is
measured by the child's own CPU time over the same idle window. The figure is the
ratio: CPU of the spinning agent / CPU of the delayed one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench._common import figures

_CHILD = r"""
import json, os, resource, sys, time
from kvfail.rig import nixl_progress
delay = int(sys.argv[1])
if delay > 0:
    nixl_progress.set_progress_delay(delay)
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("bench-idle", nixl_agent_config())
time.sleep(0.5)  # agent start-up is not the idle cost
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.monotonic()
time.sleep(float(sys.argv[2]))
r1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.monotonic()
cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
print("RESULT " + json.dumps({"cpu_per_s": cpu / (t1 - t0)}), flush=True)
os._exit(0)  # NIXL/UCX teardown at interpreter exit can crash; the figure is out
"""


def _idle_cpu(delay_us: int, window_s: float) -> float:
    env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(delay_us), str(window_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=window_s + 120,
        check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return float(json.loads(line.removeprefix("RESULT "))["cpu_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--delay-us", type=int, default=100, help="the rig's delay")
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spin, delayed = [], []
    for _ in range(args.repeats):  # interleaved: load changes hit both sides alike
        spin.append(_idle_cpu(0, args.window_s))
        delayed.append(_idle_cpu(args.delay_us, args.window_s))
    s, d = sorted(spin)[len(spin) // 2], sorted(delayed)[len(delayed) // 2]
    print(f"{'idle NIXL agent':32}{'CPU-s per s':>12}")
    print(f"{'NIXL default (pthrDelay 0)':32}{s:>12.3f}")
    print(f"{f'kvfail rig (pthrDelay {args.delay_us} us)':32}{d:>12.3f}")
    print(figures(spin_cpu_per_s=s, delayed_cpu_per_s=d, idle_cpu_ratio=s / max(d, 1e-6)))


if __name__ == "__main__":
    main()
