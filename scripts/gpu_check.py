"""The NIXL fence's premise, checked on GPU memory (a CUDA machine; not part of CI).

kvfail's NIXL connector hands a failed load's blocks back only once every READ handle of
the load is ``DONE`` or ``ERR``; while one is ``PROC`` the blocks stay held, because a
reply already on its way can still land. The CPU suite proves this over UCX's TCP and
shared-memory paths into DRAM. With KV caches in VRAM, UCX moves the bytes by other means
(CUDA IPC between processes on one GPU, or staged through host memory), so the premise
is checked here on those paths, with a real P process that is killed and frozen:

* ``pull``: every block D reads from P's memory holds P's bytes (the byte oracle);
* ``killed``: P is SIGKILLed with many READs in flight. Each handle should reach ``DONE``
  or ``ERR`` within the deadline (one left in ``PROC`` is reported: a hold then lasts
  until kvfail's liveness probe proves P gone), and once one has, D's block never
  changes again (no write after a terminal state: what the fence relies on), and a
  ``DONE`` block holds P's bytes;
* ``frozen``: P is SIGSTOPped before D reads. A one-sided read needs nothing from P's
  CPU, so it may complete; either way a ``DONE`` block holds P's bytes.

Run from the repository root, with torch and nixl importable:
``python3 scripts/gpu_check.py [--memory vram|dram] [--tls default|host-staged|tcp]``.
``--memory dram --tls tcp`` runs the same checks on any machine (how the script itself
is tried without a GPU). It prints one JSON record per check and, last, ``name=value`` verdicts
(1 = the premise held, 0 = it broke). Exit 0 only if every check held.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfail.rig.processes import PeerProcess

BLOCKS = 64
READY = "GPU-P-READY"
TERMINAL_DEADLINE_S = 30.0
SETTLE_S = 2.0
# UCX transports per mode. Every mode keeps UCX's network traffic on loopback; "default"
# lets UCX choose its GPU paths (CUDA IPC on one GPU), "host-staged" forces copies through
# host memory and TCP, as between hosts, and "tcp" is the CPU suite's own path.
TLS: dict[str, dict[str, str]] = {
    "default": {},
    "host-staged": {"UCX_TLS": "tcp,cuda_copy,self"},
    "tcp": {"UCX_TLS": "tcp,self"},
}
# torch device, NIXL memory type and block size of each place the KV can live. Blocks are
# large so that READs are still in flight when P is cut (GPU copies are fast); DRAM's are
# smaller so that the check also runs on a small CPU machine.
MEMORY = {"vram": ("cuda", "VRAM", 32 << 20), "dram": ("cpu", "DRAM", 1 << 20)}


def block_pattern(torch: Any, memory: str) -> Any:
    """Block ``b`` holds ``(b * 131 + i * 7 + 1) mod 251``: no two blocks alike, no zero run."""
    device, _, size = MEMORY[memory]
    idx = torch.arange(size, device=device, dtype=torch.int32).unsqueeze(0)
    blocks = torch.arange(BLOCKS, device=device, dtype=torch.int32).unsqueeze(1)
    return ((blocks * 131 + idx * 7 + 1) % 251).to(torch.uint8)


def agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def block_descs(nixl: Any, kv: Any, memory: str) -> Any:
    """One transfer descriptor per block, in upstream's (address, bytes, device) form."""
    index, size = kv.device.index or 0, MEMORY[memory][2]
    rows = [(kv[b].data_ptr(), size, index) for b in range(BLOCKS)]
    return nixl.get_xfer_descs(rows, MEMORY[memory][1])


def sync(torch: Any, memory: str) -> None:
    if memory == "vram":
        torch.cuda.synchronize()


def serve_p(meta_path: Path, memory: str) -> None:
    """P: fill its KV with the pattern, publish the agent and its blocks, then idle."""
    import torch

    kv = block_pattern(torch, memory)
    sync(torch, memory)
    p = agent("kvfail-gpu-p")
    p.register_memory(p.get_reg_descs(kv))
    meta = {
        "agent": base64.b64encode(p.get_agent_metadata()).decode(),
        "blocks": base64.b64encode(p.get_serialized_descs(block_descs(p, kv, memory))).decode(),
    }
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.rename(meta_path)
    print(READY, flush=True)
    while True:  # a real P stays up until it is stopped or killed
        time.sleep(1)


class Consumer:
    """D: a KV buffer of P's shape, registered with its own NIXL agent."""

    def __init__(self, torch: Any, meta: dict[str, str], tag: str, memory: str) -> None:
        self.torch, self.memory = torch, memory
        self.expected = block_pattern(torch, memory)
        self.kv = torch.zeros_like(self.expected)
        self.nixl = agent(f"kvfail-gpu-d-{tag}")
        self.nixl.register_memory(self.nixl.get_reg_descs(self.kv))
        remote = self.nixl.add_remote_agent(base64.b64decode(meta["agent"]))
        far = self.nixl.deserialize_descs(base64.b64decode(meta["blocks"]))
        # Prepared lists and per-block indices: how upstream's NIXL worker posts its READs.
        self.local = self.nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descs(self.nixl, self.kv, memory)
        )
        self.far = self.nixl.prep_xfer_dlist(remote, far)

    def read_all(self) -> dict[int, Any]:
        handles = {}
        for b in range(BLOCKS):
            handles[b] = self.nixl.make_prepped_xfer("READ", self.local, [b], self.far, [b])
            if self.nixl.transfer(handles[b]) == "ERR":
                raise RuntimeError(f"posting the READ of block {b} failed")
        return handles

    def state(self, handle: Any) -> str:
        """The handle's state; a poll that raises (NIXL's remote-disconnect error when P
        dies) is an outcome too, named by its exception."""
        try:
            return str(self.nixl.check_xfer_state(handle))
        except Exception as exc:  # which error NIXL raises is the finding
            return f"raised {type(exc).__name__}"

    def settle(self, handles: dict[int, Any]) -> tuple[dict[int, str], dict[int, int]]:
        """Poll each handle until it leaves PROC or the deadline passes; release ended ones.

        Returns each block's state and, for each ended block, its digest at that moment.
        """
        states: dict[int, str] = {}
        at_end: dict[int, int] = {}
        end = time.monotonic() + TERMINAL_DEADLINE_S
        pending = dict(handles)
        while pending and time.monotonic() < end:
            for block, h in list(pending.items()):
                state = self.state(h)
                if state != "PROC":
                    states[block] = state
                    at_end[block] = self.digest(block)
                    with contextlib.suppress(Exception):  # NIXL may refuse; the poll said it ended
                        self.nixl.release_xfer_handle(h)
                    del pending[block]
            time.sleep(0.005)
        states.update(dict.fromkeys(pending, "PROC"))
        return states, at_end

    def wrong(self, states: dict[int, str]) -> list[int]:
        """DONE blocks that do not hold P's bytes."""
        return [
            b
            for b, s in states.items()
            if s == "DONE" and not self.torch.equal(self.kv[b], self.expected[b])
        ]

    def digest(self, block: int) -> int:
        sync(self.torch, self.memory)
        return int(self.kv[block].to(self.torch.int64).sum())


Check = Callable[[Consumer, PeerProcess], dict[str, Any]]


def pull(d: Consumer, p: PeerProcess) -> dict[str, Any]:
    states, _ = d.settle(d.read_all())
    return {"states": Counter(states.values()), "done_but_wrong": d.wrong(states)}


def killed(d: Consumer, p: PeerProcess) -> dict[str, Any]:
    handles = d.read_all()
    p.kill()
    states, at_end = d.settle(handles)
    time.sleep(SETTLE_S)
    return {
        "states": Counter(states.values()),
        "stuck_in_proc": sorted(b for b, s in states.items() if s == "PROC"),
        "written_after_terminal": sorted(b for b, v in at_end.items() if d.digest(b) != v),
        "done_but_wrong": d.wrong(states),
    }


def frozen(d: Consumer, p: PeerProcess) -> dict[str, Any]:
    p.freeze()
    states, _ = d.settle(d.read_all())
    p.thaw()
    return {"states": Counter(states.values()), "done_but_wrong": d.wrong(states)}


def held(name: str, record: dict[str, Any]) -> bool:
    """The premise: no wrong DONE block, no write after a terminal state, a clean pull whole."""
    if record["done_but_wrong"] or record.get("written_after_terminal"):
        return False
    return name != "pull" or record["states"] == {"DONE": BLOCKS}


def run(name: str, check: Check, workdir: Path, env: dict[str, str], memory: str) -> dict[str, Any]:
    import torch

    meta_path = workdir / f"p-{name}.json"
    argv = [sys.executable, __file__, "--serve-p", str(meta_path), "--memory", memory]
    with PeerProcess(argv, name=f"gpu-p-{name}", env=env) as p:
        try:
            p.wait_ready(180.0, line=READY)
        except TimeoutError:
            print(p.output_tail(), file=sys.stderr)
            raise
        d = Consumer(torch, json.loads(meta_path.read_text()), name, memory)
        record = check(d, p)
    return {"check": name, **record, "held": held(name, record)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-p", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--memory", choices=sorted(MEMORY), default="vram")
    parser.add_argument("--tls", choices=sorted(TLS), default="default")
    args = parser.parse_args()
    if args.serve_p is not None:
        serve_p(args.serve_p, args.memory)
        return 0
    import torch

    if args.memory == "vram" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing checked (--memory dram runs without one)")
        return 2
    env = {"UCX_NET_DEVICES": "lo", **TLS[args.tls]}
    os.environ.update(env)
    records = []
    with tempfile.TemporaryDirectory(prefix="kvfail-gpu-") as tmp:
        for name, check in (("pull", pull), ("killed", killed), ("frozen", frozen)):
            records.append(run(name, check, Path(tmp), env, args.memory))
            print(json.dumps({"memory": args.memory, "tls": args.tls, **records[-1]}), flush=True)
    tag = f"{args.memory}_{args.tls.replace('-', '_')}"
    print(" ".join(f"{r['check']}_{tag}={int(r['held'])}" for r in records))
    return 0 if all(r["held"] for r in records) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    # A process that made a NIXL agent can crash at a normal interpreter exit.
    os._exit(code)
