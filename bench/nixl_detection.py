"""Fault detection, upstream ``NixlConnector`` vs ``KvfailNixlConnector``, side by side.

Why this bench: a D-side failure costs what it takes to *reach the scheduler*. Both
connectors run as D engines in this one process (real ``Scheduler``, real nixl agent,
UCX over TCP 127.0.0.1, DRAM) against the same real P process (upstream's connector,
:class:`kvfail.peers.nixl.NixlPair`), so every fault hits both under the same conditions.
Policy is ``fail``: the figure is the time from fault injection to the request's terminal
state (``FINISHED_ERROR``), and the D engine steps in between. Cases of one fault are
stepped together (round-robin), as concurrent engines would be.

Faults (:mod:`kvfail.peers.nixl` injects them): ``refuse`` (side-channel port nobody
listens on: zmq retries silently, the handshake fails at its 5 s ``RCVTIMEO``);
``unknown_engine`` (P answers the handshake for another engine id); ``metadata_garbled``
/ ``metadata_layout`` (P's real side channel answers with agent bytes NIXL cannot load / a
KV layout unlike D's, see ``NixlPair.serve_bad_metadata``); ``silent`` (SIGSTOP P after
the handshake, READ stuck in ``PROC``: upstream has no deadline, reported as ``>cap s (not
reached)``);
``kill_hs`` (SIGKILL P after the handshake, before the READ: ``nixlRemoteDisconnectError``
when the READ is posted); ``kill_warm`` (a D that pulled before adds its request after P
died).

A load reported as a success is checked against P's bytes: ``ok`` means they matched,
``ok,wrong`` that the connector reported success on a failed load.

Run: ``.venv/bin/python -m bench.nixl_detection [--quick] 2>/dev/null`` (NIXL and vLLM log
to stderr; the table and the figures go to stdout). The process ends with ``os._exit``
(the nixl teardown segfault, see ``kvfail.peers.nixl``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench._common import DetectionCase, quiet, step_until_settled

SIDES: dict[str, tuple[str, str | None]] = {
    "upstream": ("NixlConnector", None),
    "kvfail": ("KvfailNixlConnector", "connectors.nixl"),
}


@dataclass
class Case(DetectionCase):
    """One request of one side under one fault; ``steps0`` counts its engine's steps."""

    steps0: int = 0


class Detection:
    """The pair, both sides' D engines, and the measurement loop."""

    def __init__(self, *, cap_s: float, deadline_s: float) -> None:
        from kvfail.peers.nixl import NixlPair

        self.cap_s = cap_s
        self.deadline_s = deadline_s
        self.pair = NixlPair(build_default_consumer=False)
        self.cases: list[Case] = []
        self._seq = 0

    def consumer(self, side: str, name: str) -> str:
        """A fresh ("cold") D engine of this side."""
        connector, module = SIDES[side]
        key = f"{side}-{name}"
        extra = {"kvfail_deadline_s": self.deadline_s} if side == "kvfail" else {}
        self.pair.consumer(
            "fail", name=key, connector=connector, connector_module=module, extra_config=extra
        )
        return key

    def warm(self, side: str, name: str) -> str:
        """A D engine that already pulled from P once (it holds P's agent)."""
        key = self.consumer(side, name)
        self.pair.warm(key)
        return key

    def rid(self, stem: str) -> str:
        self._seq += 1
        return f"{stem}-{self._seq}"

    def case(self, fault: str, side: str, consumer: str, params: dict[str, Any]) -> Case:
        """Add the request (with already-faulty params, or to an already-faulty P)."""
        c = Case(fault, side, consumer, self.rid(f"{fault}-{side}"))
        engine = self.pair.decoders[consumer]
        self.pair.add(c.req_id, params, prompt_len=100, consumer=consumer)
        c.injected_at, c.steps0 = time.monotonic(), engine.record.steps
        self.cases.append(c)
        return c

    def measure(self, cases: Iterable[Case], *, cap_s: float | None = None) -> None:
        """Step the cases' engines round-robin until every case ended or ``cap_s``."""
        cap = self.cap_s if cap_s is None else cap_s
        step_until_settled(list(cases), self.pair.decoders, cap, self._settle)

    def _settle(self, c: Case, engine: Any, now: float) -> None:
        if c.req_id in engine.scheduler.requests:
            return
        c.ended_at = now
        c.steps = engine.record.steps - c.steps0
        outputs = engine.record.outputs_for(c.req_id)
        reason = outputs[-1].finish_reason if outputs else None
        if reason is not None and reason.name == "ERROR":
            c.outcome = "failed"
        else:  # a success must carry P's bytes; one that does not is success on failure
            c.outcome = "ok" if self.pair.verify(c.req_id) else "ok,wrong"
        c.stage = _stage(engine)

    def close(self) -> None:
        self.pair.close()


def _stage(engine: Any) -> str:
    """kvfail: the stages its tracker counted on this engine; upstream: NIXL's counters."""
    worker = engine.workers[0].connector.connector_worker
    if hasattr(worker, "failure_stats"):
        stats = worker.failure_stats().as_dict()
        return ",".join(
            k.removeprefix("stage.") for k, v in stats.items() if k[:6] == "stage." and v
        )
    with contextlib.suppress(Exception):
        data = worker.xfer_stats.data
        return ",".join(k for k, v in data.items() if k.startswith("num_failed") and v)
    return ""


# --------------------------------------------------------------------------- scenarios


def run_scenarios(bench: Detection) -> None:
    """Every fault, both sides, one P (killed last)."""
    from kvfail.peers.nixl import BAD_METADATA, unknown_engine, wrong_port

    pair = bench.pair
    both = tuple(SIDES)

    def cold(fault: str, make: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        keys = {side: bench.consumer(side, f"cold-{fault}") for side in both}
        params = {side: make(pair.prefill(bench.rid(fault), 100)) for side in both}
        bench.measure([bench.case(fault, s, keys[s], params[s]) for s in both])

    cold("refuse", wrong_port)
    cold("unknown_engine", unknown_engine)
    for kind in BAD_METADATA:  # P's side channel answers every cold D with bad metadata
        fault = f"metadata_{kind}"
        keys = {side: bench.consumer(side, f"cold-{fault}") for side in both}
        params = {side: pair.prefill(bench.rid(fault), 100) for side in both}
        pair.serve_bad_metadata(kind)
        try:
            bench.measure([bench.case(fault, s, keys[s], params[s]) for s in both])
        finally:
            pair.serve_bad_metadata(None)
            pair.expire_leases(p["remote_request_id"] for p in params.values())

    # Warm D engines for the P-process faults (their handshake is done).
    silent = {side: bench.warm(side, "silent") for side in both}
    kill_warm = {side: bench.warm(side, "kill-warm") for side in both}
    kill_hs = {side: bench.consumer(side, "kill-hs") for side in both}

    # Silent P: stopped for good (until the cap) after the handshake; READ in PROC.
    params = {side: pair.prefill(bench.rid("silent"), 100) for side in both}
    pair.freeze_p()
    try:
        bench.measure([bench.case("silent", s, silent[s], params[s]) for s in both])
    finally:
        pair.thaw_p()

    # Killed P, one kill for all: cold D's that handshaked first (READ not yet posted),
    # and warm D's that add their request after P died.
    stems = ("kill_hs", "kill_warm")
    params = {(f, s): pair.prefill(bench.rid(f), 100) for f in stems for s in both}
    cases = [bench.case("kill_hs", s, kill_hs[s], params[("kill_hs", s)]) for s in both]
    for c in cases:
        engine = pair.decoders[c.consumer]
        engine.step()  # schedules the load; the handshake runs in upstream's thread
        end = time.monotonic() + 15.0
        while not pair.handshaked(engine) and time.monotonic() < end:
            time.sleep(0.005)
    pair.kill_p()  # returns once P's group is gone; no D engine is stepped meanwhile
    killed_at = time.monotonic()
    for s in both:
        cases.append(bench.case("kill_warm", s, kill_warm[s], params[("kill_warm", s)]))
    for c in cases:
        c.injected_at = killed_at
        c.steps0 = pair.decoders[c.consumer].record.steps
    bench.measure(cases)


# --------------------------------------------------------------------------- output


def report(bench: Detection, total_s: float) -> None:
    print(f"{'fault':18}{'side':10}{'outcome':9}{'s':>22}{'steps':>7}  kvfail stage")
    figures: list[str] = []
    for c in bench.cases:
        outcome = c.outcome if c.ended_at is not None else "pending"
        elapsed = c.elapsed_text(" (not reached)")
        print(f"{c.fault:18}{c.side:10}{outcome:9}{elapsed:>22}{c.steps or '':>7}  {c.stage}")
        value = f"{c.ended_at - c.injected_at:.3f}" if c.ended_at is not None else c.outcome
        figures.append(f"{c.fault}_{c.side}_s={value}")
        if c.steps is not None:
            figures.append(f"{c.fault}_{c.side}_steps={c.steps}")
    figures.append(f"deadline_s={bench.deadline_s:g} cap_s={bench.cap_s:g} total_s={total_s:.0f}")
    print(" ".join(figures))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="cap 6 s, deadline 1.5 s")
    ap.add_argument("--cap", type=float, default=None, help="give up on a case after (s)")
    ap.add_argument("--deadline", type=float, default=None, help="kvfail_deadline_s")
    args = ap.parse_args()
    cap = args.cap or (6.0 if args.quick else 15.0)
    deadline = args.deadline or (1.5 if args.quick else 3.0)
    quiet()
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    started = time.monotonic()
    rc = 0
    bench: Detection | None = None
    try:
        bench = Detection(cap_s=cap, deadline_s=deadline)
        run_scenarios(bench)
    except BaseException:
        rc = 1
        import traceback

        traceback.print_exc()
    finally:
        if bench is not None:
            with contextlib.suppress(Exception):
                bench.close()
    if bench is not None:
        report(bench, time.monotonic() - started)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # any process holding a nixl agent segfaults at a normal exit


if __name__ == "__main__":
    main()
