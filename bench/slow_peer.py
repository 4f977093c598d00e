"""A slow P, upstream's connectors vs kvfail's: the client's answer and the quarantine.

Why this bench: a P that is slow but alive is the one fault where failing fast can cost
wrong KV. kvfail fails the load at its deadline (the client gets its error, or recompute
starts) and keeps the load's blocks out of the free pool until P's late write is over;
upstream waits for P. The figures a user weighs are: when the client hears back, and how
long D's blocks stay out of use.

Set-up: one real P process per transport (upstream's producer: Mooncake over TCP, NIXL
over UCX/TCP), and for each side a warm D engine in this process (real ``Scheduler``,
policy ``fail``). P answers one pull ``--delay`` seconds late: Mooncake's P holds the pull
that long and then pushes (its real push, into D's memory); NIXL's P is stopped (SIGSTOP)
once D's READ is posted and continued after ``--delay``, so the READ completes then. D is
stepped until the request ended and its blocks are all free again (bounded by ``--cap``).

Columns, in seconds from D adding the request: ``answer`` = the request's terminal state
(``error`` or ``ok``, what the client would get); ``blocks back`` = D's free blocks back
to what they were before the request; ``quarantine`` = blocks back - answer (kvfail: the
time its blocks were held after the failure was reported; upstream holds them the whole
time the request waits, and answers only when P does).

Run: ``.venv/bin/python -m bench.slow_peer [--delay 4] [--deadline 1.5] 2>/dev/null``; the
last line is ``name=value`` figures. The process ends with ``os._exit`` (the nixl teardown
segfault, see ``kvfail.peers.nixl``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench._common import figures, quiet

SIDES: dict[str, dict[str, tuple[str, str | None]]] = {
    "mooncake": {
        "upstream": ("MooncakeConnector", None),
        "kvfail": ("KvfailMooncakeConnector", "connectors.mooncake"),
    },
    "nixl": {
        "upstream": ("NixlConnector", None),
        "kvfail": ("KvfailNixlConnector", "connectors.nixl"),
    },
}


@dataclass
class Result:
    transport: str
    side: str
    outcome: str = "pending"
    answer_s: float | None = None
    blocks_back_s: float | None = None

    @property
    def quarantine_s(self) -> float | None:
        if self.answer_s is None or self.blocks_back_s is None:
            return None
        return max(0.0, self.blocks_back_s - self.answer_s)


def _mooncake_pair(deadline_s: float, delay_s: float) -> Any:
    from kvfail.peers.mooncake import MooncakePair

    # P's own expiry must outlast the delay, or P gives the pull up instead of pushing.
    return MooncakePair(
        policy="fail",
        connector="MooncakeConnector",
        p_connector="MooncakeConnector",
        extra_config={"kvfail_deadline_s": deadline_s},
        abort_request_timeout_s=int(delay_s + 30),
    )


def _nixl_pair() -> Any:
    from kvfail.peers.nixl import NixlPair

    return NixlPair(build_default_consumer=False)


def _consumer(transport: str, pair: Any, side: str, deadline_s: float) -> Any:
    connector, module = SIDES[transport][side]
    extra = {"kvfail_deadline_s": deadline_s} if side == "kvfail" else {}
    if transport == "nixl":
        return pair.consumer(
            "fail",
            name=f"{side}-slow",
            connector=connector,
            connector_module=module,
            extra_config=extra,
        )
    pair.connector, pair.connector_module = connector, module
    return pair.consumer("fail", name=f"{side}-slow")


def _warm(pair: Any, engine: Any, rid: str) -> None:
    pair.prefill_and_add(rid, 100, consumer=engine)
    run = pair.run([rid], consumer=engine, timeout_s=60)
    if not run.ok:
        raise RuntimeError(f"warm-up {rid} failed: {run}")


def measure(
    transport: str, pair: Any, side: str, *, deadline_s: float, delay_s: float, cap_s: float
) -> Result:
    engine = _consumer(transport, pair, side, deadline_s)
    _warm(pair, engine, f"warm-{transport}-{side}")
    pool = engine.scheduler.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    rid = f"slow-{transport}-{side}"
    result = Result(transport, side)
    thaw: threading.Timer | None = None
    if transport == "mooncake":
        params = pair.prefill(rid, 100)
        pair.inject(rid, "delay", delay_s=delay_s)
        pair.add(rid, params, prompt_len=100, consumer=engine)
        t0 = time.monotonic()
    else:
        pair.prefill_and_add(rid, 100, consumer=engine)
        t0 = time.monotonic()
        pair.fault_after_handshake(rid, "freeze", consumer=engine)  # warm: at once
        thaw = threading.Timer(max(0.0, delay_s - (time.monotonic() - t0)), pair.thaw_p)
        thaw.start()
    try:
        while time.monotonic() - t0 < cap_s:
            engine.step()
            if transport == "nixl":
                pair.observe(engine)
            now = time.monotonic() - t0
            if result.answer_s is None and rid not in engine.scheduler.requests:
                outputs = engine.record.outputs_for(rid)
                reason = outputs[-1].finish_reason if outputs else None
                failed = reason is not None and reason.name == "ERROR"
                result.outcome = "error" if failed else "ok"
                result.answer_s = now
            if result.answer_s is not None and pool.get_num_free_blocks() >= free0:
                result.blocks_back_s = now
                break
            time.sleep(0.005)
    finally:
        if thaw is not None:
            thaw.join()
    if result.answer_s is None:
        result.outcome = f">{cap_s:g}s"
    return result


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay", type=float, default=4.0, help="P answers this late (s)")
    ap.add_argument("--deadline", type=float, default=1.5, help="kvfail's D deadline (s)")
    ap.add_argument("--cap", type=float, default=60.0, help="bound on one case (s)")
    ap.add_argument("--transport", choices=["mooncake", "nixl", "both"], default="both")
    args = ap.parse_args(argv)
    if args.delay <= args.deadline:
        ap.error("--delay must exceed --deadline: the P must answer after kvfail's deadline")
    quiet()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    transports = ["mooncake", "nixl"] if args.transport == "both" else [args.transport]
    results: list[Result] = []
    for transport in transports:
        pair = (
            _mooncake_pair(args.deadline, args.delay) if transport == "mooncake" else _nixl_pair()
        )
        try:
            for side in ("upstream", "kvfail"):
                results.append(
                    measure(
                        transport,
                        pair,
                        side,
                        deadline_s=args.deadline,
                        delay_s=args.delay,
                        cap_s=args.cap,
                    )
                )
        finally:
            with contextlib.suppress(Exception):
                pair.close()
    print(f"slow P: answers {args.delay:g} s late; kvfail's deadline {args.deadline:g} s")
    head = ("transport", "side", "client", "answer", "blocks back", "quarantine")
    print(f"{head[0]:10} {head[1]:9} {head[2]:8} {head[3]:>7} {head[4]:>12} {head[5]:>11}")
    for r in results:
        print(
            f"{r.transport:10} {r.side:9} {r.outcome:8} {_fmt(r.answer_s):>7} "
            f"{_fmt(r.blocks_back_s):>12} {_fmt(r.quarantine_s):>11}"
        )
    values: dict[str, Any] = {}
    for r in results:
        stem = f"{r.transport}_{r.side}"
        values[f"{stem}_answer_s"] = -1.0 if r.answer_s is None else round(r.answer_s, 3)
        values[f"{stem}_outcome"] = r.outcome
        values[f"{stem}_quarantine_s"] = (
            -1.0 if r.quarantine_s is None else round(r.quarantine_s, 3)
        )
    print(figures(**values))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
