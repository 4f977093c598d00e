"""Writes a long-lived Mooncake P loses to D engines built one after another: Mooncake's
defaults vs the rig's P (rig patch ``mooncake_p_peer_caches``: its settings, and one more
write after a failed one).

Why it matters here: the suite builds a D engine for every scenario, all in one process,
and Mooncake gives each engine random ports out of about 2,000, so over a session a
long-lived P meets new D engines at addresses ended ones had. One D process builds engine
after engine (each with a freshly allocated buffer, ended before the next); P, a real
transfer engine in its own process, writes to each in turn and D checks the bytes. The
same run measures P with Mooncake's defaults and P with the rig's settings, interleaved in
rounds so load changes hit both alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from bench._common import figures
from kvfail.peers.mooncake import P_PEER_CACHE_ENV
from kvfail.peers.producer import WRITE_RETRIES
from kvfail.rig.processes import PeerProcess

#: Bound on one engine build or one loopback write (each takes well under a second).
WAIT_S = 60.0
FILL = 7
#: First port of the narrowed range D's engines draw from (``--ports``).
PORTS_FROM = 20000
#: Mooncake's own values of the rig's two settings, stated so the environment cannot leak in.
MOONCAKE_DEFAULTS = {"MC_DISABLE_METACACHE": "0", "MC_TCP_ENABLE_CONNECTION_POOL": "1"}

#: D: "new <bytes>" builds an engine with one registered buffer of that size (a size that
#: changes gives it a new address, as a new engine's KV tensors have) and prints
#: ``engine <port> <addr>``; "check" prints ``sum <n>``; "end" frees the engine.
D_CODE = """
import gc, sys
import numpy as np
from mooncake.engine import TransferEngine
engine = buf = None
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "new":
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = np.zeros(int(arg[0]), dtype=np.uint8)
        assert engine.batch_register_memory([buf.ctypes.data], [buf.nbytes]) == 0
        print("engine", engine.get_rpc_port(), buf.ctypes.data, flush=True)
    elif cmd == "check":
        print("sum", int(buf.sum()), flush=True)
    elif cmd == "end":
        engine.batch_unregister_memory([buf.ctypes.data])
        engine = None  # buf stays until the next engine's is allocated: a new address
        gc.collect()
        print("ended", flush=True)
"""

#: P: one engine and a source buffer of FILL bytes (argv 1); "<port> <addr> <bytes>"
#: writes that many bytes to that D, up to 1 + argv 2 times until one succeeds, and prints
#: ``wrote <return code> <writes>``.
P_CODE = """
import sys
import numpy as np
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = np.full(1 << 16, int(sys.argv[1]), dtype=np.uint8)
assert engine.batch_register_memory([src.ctypes.data], [src.nbytes]) == 0
print("ready", flush=True)
for line in sys.stdin:
    port, addr, size = line.split()
    for n in range(1 + int(sys.argv[2])):
        ret = engine.batch_transfer_sync_write(
            f"127.0.0.1:{port}", [src.ctypes.data], [int(addr)], [int(size)]
        )
        if ret == 0:
            break
    print("wrote", ret, n + 1, flush=True)
"""


def _ask(peer: PeerProcess, line: str, answer: str) -> list[str]:
    """Send one command line; the words of the answer line it produced."""
    seen = len(peer.stdout_lines())
    peer.write_stdin(line + "\n")
    peer.wait_ready(WAIT_S, predicate=lambda: len(peer.stdout_lines()) > seen)
    words = peer.stdout_lines()[seen].split()
    if not words or words[0] != answer:
        raise RuntimeError(f"{peer.name} answered {words} to {line!r}\n{peer.output_tail()}")
    return words


@dataclass
class Tally:
    writes: int = 0
    failed: int = 0
    #: Writes to an engine at an address an ended engine had.
    reused: int = 0
    failed_reused: int = 0
    #: Writes P made again after one failed (the rig's retry).
    retried: int = 0


def _one_side(
    p_env: Mapping[str, str],
    retries: int,
    engines: int,
    ports: range | None,
    seed: int,
    tally: Tally,
) -> None:
    """One D process, one P: ``engines`` D engines in turn, one write each (written again
    up to ``retries`` times after a failure); D's engines take their ports from ``ports``
    (None: Mooncake's own range)."""
    quiet = {"MC_LOG_LEVEL": "FATAL"}
    d_env = dict(quiet)
    if ports is not None:
        d_env |= {"MC_MIN_RPC_PORT": str(ports.start), "MC_MAX_RPC_PORT": str(ports.stop - 1)}
    seen: set[str] = set()
    with (
        PeerProcess([sys.executable, "-c", D_CODE], name="bench-d", env=d_env, stdin=True) as d,
        PeerProcess(
            [sys.executable, "-c", P_CODE, str(FILL), str(retries)],
            name="bench-p",
            env={**p_env, **quiet},
            stdin=True,
        ) as p,
    ):
        p.wait_ready(WAIT_S, line="ready")
        for i in range(engines):
            size = 4096 + 64 * ((seed * 7919 + i * 104729) % 900)
            _, port, addr = _ask(d, f"new {size}", "engine")
            reused = port in seen
            seen.add(port)
            _, code, writes = _ask(p, f"{port} {addr} {size}", "wrote")
            ret = int(code)
            tally.retried += int(writes) - 1
            landed = int(_ask(d, "check", "sum")[1]) == size * FILL
            _ask(d, "end", "ended")
            ok = ret == 0 and landed
            tally.writes += 1
            tally.failed += not ok
            tally.reused += reused
            tally.failed_reused += reused and not ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", type=int, default=150, help="D engines per side and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--ports",
        type=int,
        default=0,
        help="D's engines draw their ports from this many (from 20000, below the ephemeral "
        "range) instead of Mooncake's ~2,000 (0, the default)",
    )
    args = ap.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "FATAL")
    ports = range(PORTS_FROM, PORTS_FROM + args.ports) if args.ports else None
    default, rig = Tally(), Tally()
    for r in range(args.rounds):
        _one_side(MOONCAKE_DEFAULTS, 0, args.engines, ports, r, default)
        _one_side(P_PEER_CACHE_ENV, WRITE_RETRIES, args.engines, ports, r, rig)
    print(f"{'P':28}{'writes':>8}{'failed':>8}{'retried':>9}{'to reused':>11}{'failed':>8}")
    for name, t in (("Mooncake defaults", default), ("kvfail rig", rig)):
        print(
            f"{name:28}{t.writes:>8}{t.failed:>8}{t.retried:>9}{t.reused:>11}{t.failed_reused:>8}"
        )
    print(
        figures(
            default_failed_writes=default.failed,
            default_writes_to_reused=default.reused,
            default_failed_to_reused=default.failed_reused,
            rig_failed_writes=rig.failed,
            rig_retried_writes=rig.retried,
            rig_writes_to_reused=rig.reused,
        )
    )


if __name__ == "__main__":
    main()
