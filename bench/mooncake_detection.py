"""Fault detection, upstream ``MooncakeConnector`` vs ``KvfailMooncakeConnector``, side by side.

Why this bench: a D-side failure costs what it takes to *reach the scheduler*. Both
connectors run as D engines in this one process (real ``Scheduler``, real TransferEngine
over tcp 127.0.0.1) against the same real P process (upstream's connector,
:class:`kvfail.peers.mooncake.MooncakePair`), so every fault hits both under the same
conditions. Under ``--policy fail`` (the default) the figure is the time from fault
injection to the request's terminal state (``FINISHED_ERROR``); under ``recompute``, to
its rescheduling: the step after which the scheduler has taken the failure and the
request has left ``WAITING_FOR_REMOTE_KVS`` to be computed locally (``--policy both``
runs the whole table once per policy, each with its own P).

Columns: ``s`` = fault injection -> terminal (wall); ``steps`` = D engine steps in
between; ``surf->end`` = from the moment the connector *learned* of the failure (upstream:
its ``_handle_failed_recv`` was called; kvfail: the tracker recorded it) to the terminal
state, in ms and in that engine's steps. Upstream figures that would take longer than
``--cap`` are reported as ``>cap`` (not waited out: 65-540 s).

Targets (kvfail): active faults <= 1 step after the error surfaces and < 100 ms wall;
silent P <= deadline + 1 step; killed P <= 1 s.

Protocol faults (``ERROR`` reply, ``err_reqs``, ``FINISH`` naming nothing) are armed in
the real P with ``MooncakePair.inject`` when kvfail.peers has it, else reported "n/a".

Run: ``.venv/bin/python -m bench.mooncake_detection [--quick] 2>/dev/null`` (Mooncake's
glog writes to stderr; the table and the figures go to stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bench._common import DetectionCase, quiet, step_until_settled

SIDES: dict[str, tuple[str, str | None]] = {
    "upstream": ("MooncakeConnector", None),
    "kvfail": ("KvfailMooncakeConnector", "connectors.mooncake"),
}


@dataclass
class Case(DetectionCase):
    """One request of one side under one fault, with when its failure surfaced."""

    surfaced_at: float | None = None
    steps_after_surface: int | None = None


@dataclass
class _Probe:
    """Per-engine instrumentation: when a failure surfaced, and step start times."""

    surfaced: dict[str, tuple[float, str]] = field(default_factory=dict)
    step_starts: list[float] = field(default_factory=list)


class Detection:
    """The pair, both sides' D engines, and the measurement loop."""

    def __init__(
        self, *, cap_s: float, deadline_s: float, probe_s: float, policy: str = "fail"
    ) -> None:
        from kvfail.peers.mooncake import MooncakePair

        self.policy = policy
        self.cap_s = cap_s
        self.deadline_s = deadline_s
        self.pair = MooncakePair(
            policy="fail",
            connector="MooncakeConnector",
            p_connector="MooncakeConnector",
            extra_config={
                "kvfail_deadline_s": deadline_s,
                "kvfail_probe_interval_s": probe_s,
            },
            abort_request_timeout_s=5,
        )
        self.probes: dict[str, _Probe] = {}
        self.cases: list[Case] = []
        #: When the killed P was reaped (its sockets closed), for the kill cases.
        self.reaped_at: float | None = None
        self._seq = 0

    # ------------------------------------------------------------------ engines

    def consumer(self, side: str, name: str) -> str:
        """A fresh ("cold") D engine of this side, instrumented."""
        pair = self.pair
        pair.connector, pair.connector_module = SIDES[side]
        key = f"{side}-{name}"
        engine = pair.consumer(self.policy, name=key)
        probe = self.probes[key] = _Probe()
        for worker in engine.workers:
            cw = worker.connector.connector_worker  # type: ignore[attr-defined]
            if side == "kvfail":
                cw.drain_step = _stamp_drain(cw.drain_step, probe)
            else:
                cw._handle_failed_recv = _stamp_failed_recv(cw._handle_failed_recv, probe)
        return key

    def warm(self, side: str, name: str) -> str:
        """A D engine that already pulled from P once (it cached P's side channel)."""
        key = self.consumer(side, name)
        rid = self._rid(f"{key}-warmup")
        self.pair.prefill_and_add(rid, prompt_len=40, consumer=key)
        run = self.pair.run([rid], consumer=key, timeout_s=30)
        if not run.ok or not self.pair.verify(rid):
            raise RuntimeError(f"warm-up of {key} failed: {run}")
        return key

    def _rid(self, stem: str) -> str:
        self._seq += 1
        return f"{stem}-{self._seq}"

    # ------------------------------------------------------------------ measuring

    def case(
        self,
        fault: str,
        side: str,
        consumer: str,
        params: dict[str, Any],
        inject: str | None = None,
    ) -> Case:
        """Add the request (with already-faulty params, to an already-faulty P, or with
        P armed to answer its pull with the protocol fault ``inject``)."""
        rid = self._rid(f"{fault}-{side}")
        c = Case(fault, side, consumer, rid)
        if inject is not None:
            self.pair.inject(rid, inject)  # type: ignore[attr-defined]
        self.pair.add(rid, params, prompt_len=100, consumer=consumer)
        c.injected_at = time.monotonic()
        self.cases.append(c)
        return c

    def measure(self, cases: Iterable[Case], *, cap_s: float | None = None) -> None:
        """Step the cases' engines round-robin until every case ended or ``cap_s``."""
        cases = list(cases)
        steps0 = {c.req_id: self.pair.decoders[c.consumer].record.steps for c in cases}
        step_until_settled(
            cases,
            self.pair.decoders,
            self.cap_s if cap_s is None else cap_s,
            lambda c, engine, now: self._settle(c, engine, now, steps0[c.req_id]),
            before_step=lambda key: self.probes[key].step_starts.append(time.monotonic()),
        )

    def _settle(self, c: Case, engine: Any, now: float, steps0: int) -> None:
        from vllm.v1.request import RequestStatus

        request = engine.scheduler.requests.get(c.req_id)
        if request is not None:
            if self.policy != "recompute":
                return  # fail: only the terminal state counts
            # recompute: "ended" = rescheduled, i.e. the failure reached the scheduler and
            # the request no longer waits for remote KV (it will be computed locally).
            failed = any(c.req_id in r.failed_requests for r in engine.record.scheduler_reports())
            if not failed or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                return
            c.outcome = "resched"
        else:
            outputs = engine.record.outputs_for(c.req_id)
            reason = outputs[-1].finish_reason if outputs else None
            c.outcome = "failed" if reason is not None and reason.name == "ERROR" else "ok"
        c.ended_at = now
        c.steps = engine.record.steps - steps0
        probe = self.probes[c.consumer]
        surfaced = probe.surfaced.get(c.req_id)
        if surfaced is not None:
            c.surfaced_at, c.stage = surfaced
            c.steps_after_surface = sum(1 for t in probe.step_starts if surfaced[0] < t <= now)

    def close(self) -> None:
        self.pair.close()


def _stamp_drain(inner: Callable[[], Any], probe: _Probe) -> Callable[[], Any]:
    def drain_step() -> Any:
        report = inner()
        for req_id, failure in report.failures:
            probe.surfaced.setdefault(req_id, (failure.at, str(failure.stage)))
        return report

    return drain_step


def _stamp_failed_recv(inner: Callable[..., Any], probe: _Probe) -> Callable[..., Any]:
    def handle_failed_recv(pull_metas: Any, req_ids: Any, reason: str) -> Any:
        now = time.monotonic()
        for req_id in req_ids:
            probe.surfaced.setdefault(req_id, (now, reason[:40]))
        return inner(pull_metas, req_ids, reason)

    return handle_failed_recv


# --------------------------------------------------------------------------- scenarios


def run_scenarios(bench: Detection, *, slow_stop_s: float) -> list[str]:
    """Every fault, both sides; returns the faults marked n/a (with why)."""
    from kvfail.peers.mooncake import MooncakePair, refused_bootstrap, unknown_engine

    pair = bench.pair
    both = tuple(SIDES)

    def cold_cases(
        fault: str,
        make: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        together: bool,
        inject: str | None = None,
    ) -> None:
        """Fresh D engines (they must query the bootstrap server); measured one side at a
        time, so neither pays for the other's steps, or ``together`` when capped."""
        ready = []
        for side in both:
            key = bench.consumer(side, f"cold-{fault}")
            ready.append((side, key, make(pair.prefill(bench._rid(fault), 100))))
        if together:
            bench.measure([bench.case(fault, *r, inject=inject) for r in ready])
        else:
            for r in ready:
                bench.measure([bench.case(fault, *r, inject=inject)])

    # Active faults on the bootstrap leg (a cold D must query it).
    cold_cases("refuse", refused_bootstrap, together=False)
    cold_cases("unknown_engine", unknown_engine, together=False)
    proxy = pair.bootstrap_proxy()
    proxy.reset()
    cold_cases("reset", lambda p: MooncakePair.via_proxy(p, proxy), together=False)
    hung = pair.bootstrap_proxy()
    hung.blackhole()
    cold_cases("bootstrap_hung", lambda p: MooncakePair.via_proxy(p, hung), together=True)

    # Protocol faults answered by the real P (P-side injection, where kvfail.peers has it).
    missing: list[str] = []
    protocol = (
        ("error_reply", "error_response", False),
        ("err_reqs", "err_reqs", False),
        ("finish_no_result", "finish_without_result", True),
    )
    for fault, inject, together in protocol:
        if not hasattr(pair, "inject"):
            missing.append(f"{fault}: n/a: needs P-side injection")
            continue
        cold_cases(fault, dict, together=together, inject=inject)

    # Warm D engines for the P-process faults.
    warm = {(name, side): bench.warm(side, name) for name in ("slow", "silent") for side in both}
    kill_warm = {side: bench.warm(side, "kill-warm") for side in both}
    kill_mid = {side: bench.warm(side, "kill-mid") for side in both}
    kill_cold = {side: bench.consumer(side, "kill-cold") for side in both}

    # A P that is only slow: stopped for less than the deadline, then resumed.
    params = {side: pair.prefill(bench._rid("slow"), 100) for side in both}
    pair.freeze_p()
    cases = [bench.case("slow_p_ok", s, warm[("slow", s)], params[s]) for s in both]
    try:
        bench.measure(cases, cap_s=slow_stop_s)
    finally:
        pair.thaw_p()
    bench.measure([c for c in cases if c.ended_at is None])

    # Silent P: stopped for good (until the cap), warm.
    params = {side: pair.prefill(bench._rid("silent"), 100) for side in both}
    pair.freeze_p()
    try:
        bench.measure([bench.case("silent", s, warm[("silent", s)], params[s]) for s in both])
    finally:
        pair.thaw_p()

    # Killed P, one kill for all: cold D (queries the dead bootstrap server), warm D with a
    # pull in flight when P dies, warm D that starts its pull after P died.
    stems = ("kill_cold", "kill_midpull", "kill_warm")
    params = {(f, s): pair.prefill(bench._rid(f), 100) for f in stems for s in both}
    pair.freeze_p()  # so the mid-pull requests surely wait on P
    mid = [bench.case("kill_midpull", s, kill_mid[s], params[("kill_midpull", s)]) for s in both]
    bench.measure(mid, cap_s=0.3)
    killed_at = time.monotonic()
    pair.kill_p()  # returns once P is reaped: the kernel has closed its sockets
    bench.reaped_at = time.monotonic()
    cases = list(mid)
    for s in both:
        cases.append(bench.case("kill_warm", s, kill_warm[s], params[("kill_warm", s)]))
        cases.append(bench.case("kill_cold", s, kill_cold[s], params[("kill_cold", s)]))
    for c in cases:
        c.injected_at = killed_at
    bench.measure(cases)
    return missing


# --------------------------------------------------------------------------- output


def report(bench: Detection, missing: list[str]) -> list[str]:
    """Print the table; return the figures (``<fault>_<side>[_recompute]_s=...``)."""
    print(f"policy={bench.policy}")
    suffix = "" if bench.policy == "fail" else f"_{bench.policy}"
    head = f"{'fault':18}{'side':10}{'outcome':9}{'s':>9}{'steps':>7}{'surf->end ms':>14}"
    head += f"{'steps':>7}  stage/reason"
    print(head)
    figures: list[str] = []
    for c in bench.cases:
        surf_ms = steps_after = ""
        if c.surfaced_at is not None and c.ended_at is not None:
            surf_ms = f"{(c.ended_at - c.surfaced_at) * 1000:.1f}"
            steps_after = str(c.steps_after_surface)
        outcome = c.outcome if c.ended_at is not None else "pending"
        print(
            f"{c.fault:18}{c.side:10}{outcome:9}{c.elapsed_text():>9}{c.steps or '':>7}"
            f"{surf_ms:>14}{steps_after:>7}  {c.stage}"
        )
        value = c.elapsed_text().removesuffix("s")
        figures.append(f"{c.fault}_{c.side}{suffix}_s={value}")
        if c.side == "kvfail" and steps_after:
            figures.append(f"{c.fault}_{c.side}{suffix}_surf_steps={steps_after}")
        if c.fault == "kill_midpull" and c.surfaced_at is not None and bench.reaped_at:
            # The held connection's end, not the kill call (whose reaping of a vLLM
            # process takes a while): negative when D knew before the reap returned.
            after = (c.surfaced_at - bench.reaped_at) * 1000
            figures.append(f"{c.fault}_{c.side}{suffix}_surfaced_after_reap_ms={after:.1f}")
    for line in missing:
        print(f"{line.split(':')[0]:18}{'both':10}{line.split(':', 1)[1].strip()}")
    print()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="cap 6 s, deadline 1.5 s")
    ap.add_argument("--cap", type=float, default=None, help="give up on a case after (s)")
    ap.add_argument("--deadline", type=float, default=None, help="kvfail_deadline_s")
    ap.add_argument("--probe", type=float, default=0.2, help="kvfail_probe_interval_s")
    ap.add_argument("--policy", choices=("fail", "recompute", "both"), default="fail")
    args = ap.parse_args()
    cap = args.cap or (6.0 if args.quick else 15.0)
    deadline = args.deadline or (1.5 if args.quick else 3.0)
    quiet()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    started = time.monotonic()
    figures: list[str] = []
    policies = ("fail", "recompute") if args.policy == "both" else (args.policy,)
    for policy in policies:
        bench = Detection(cap_s=cap, deadline_s=deadline, probe_s=args.probe, policy=policy)
        try:
            missing = run_scenarios(bench, slow_stop_s=min(1.0, deadline / 2))
        finally:
            with contextlib.suppress(Exception):
                bench.close()
        figures += report(bench, missing)
    total = time.monotonic() - started
    figures.append(f"deadline_s={deadline:g} cap_s={cap:g} total_s={total:.0f}")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
