"""Evidence for a load that never ended: what D's tracker and ranks hold for it, and what
P's processes are doing (kernel state, counters, busiest threads, every thread's stacks).

Apart from :mod:`kvfail.peers.base` because reading evidence off live processes is a job
of its own, and only a stuck scenario's report asks for it; the pair only supplies its P
and the function each D rank runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvfail.rig.processes import PeerProcess
from kvfail.rig.procfs import busy_threads, proc_state
from kvfail.rig.stacks import STACK_SIGNAL, native_stacks, summarize_stacks

if TYPE_CHECKING:
    from kvfail.harness import Engine

#: How long a stuck scenario's evidence waits for P's counters (a P that does not answer
#: in this time is itself the evidence).
P_STATS_TIMEOUT_S = 5.0
#: How long each of P's processes gets to write its threads' stacks, and how many
#: threads' stacks are shown in all.
P_STACKS_WAIT_S = 1.0
P_STACKS_MAX = 40
#: Set to ``1``: a stuck scenario's evidence has every thread's stacks of P's and D's
#: processes even when P answers (a few seconds per scenario that stalls; off by default
#: because upstream connectors stall by design in many scenarios).
STUCK_STACKS_ENV = "KVFAIL_STUCK_STACKS"


def tracker_state(worker: Any, req_id: str) -> str | None:
    """What a kvfail worker's tracker holds for ``req_id`` (None for an upstream worker):
    part of a stuck load's evidence."""
    tracker = getattr(worker, "_kvfail_tracker", None)
    if tracker is None:
        return None
    return (
        f"kvfail tracked {tracker.is_tracked(req_id)} failure {tracker.failure_of(req_id)} "
        f"delivered {tracker.was_delivered(req_id)}"
    )


class StuckEvidence:
    """The evidence half of :class:`~kvfail.peers.base.PeerPair`, which sets
    :attr:`load_state` and :attr:`p`."""

    load_state: Callable[[Any, str], str] | None
    p: Any

    def stuck_state(self, engine: Engine, req_ids: Iterable[str]) -> list[str]:
        """What D's ranks hold for requests that never finished, then P's side (evidence
        only): each rank runs the subclass's :attr:`load_state`. With
        :data:`STUCK_STACKS_ENV` set, every stack of P's and D's processes follows."""
        lines: list[str] = []
        if self.load_state is not None:
            lines += [
                f"{rid} rank {w.rank}: {w.call(self.load_state, rid)}"
                for rid in req_ids
                for w in engine.workers
            ]
        stacks = os.environ.get(STUCK_STACKS_ENV) == "1"
        lines += self.p_state(stacks=stacks)
        if stacks:
            # D's rank processes (at TP 1 D is this process: gdb cannot stop itself).
            d_pids = [w.process.pid for w in engine.workers if w.process and w.process.pid]
            lines += [f"D native: {s}" for pid in d_pids for s in native_stacks(pid)]
        return lines

    def p_state(self, *, stacks: bool = False) -> list[str]:
        """P's processes (kernel state of P and each of its ranks) and, when it answers
        within :data:`P_STATS_TIMEOUT_S`, its engine's counters; when it does not (or
        ``stacks``), its processes' busiest threads and every thread's Python and native
        stack: whether a load waits on a P that is busy, hung or idle, and on what."""
        producer = self.p
        if producer is None:
            return ["P: none"]
        proc = producer.process
        ready = producer.ready or {}
        pids: list[int] = [pid for pid in ready.get("rank_pids", []) if pid != proc.pid]
        ranks = ", ".join(f"{pid} {proc_state(pid) or 'gone'}" for pid in pids)
        line = f"P {ready.get('engine_id', '(starting)')} pid {proc.pid} {proc.state or 'gone'}"
        line += f", ranks [{ranks}]"
        if not proc.alive or proc.frozen or producer.ready is None:
            return [line]
        started = time.monotonic()
        try:
            stats = producer.stats(timeout_s=P_STATS_TIMEOUT_S)
        except Exception as exc:  # evidence only: a P that does not answer is the finding
            line += f"; no answer to stats in {P_STATS_TIMEOUT_S:g} s ({type(exc).__name__})"
            stacks = True
        else:
            keys = (
                "steps",
                "pending_requests",
                "free_blocks",
                "write_retries",
                "oldest_write_s",
                "crashed",
            )
            counters = ", ".join(f"{k} {stats[k]!r}" for k in keys if k in stats)
            line += f"; stats in {time.monotonic() - started:.2f} s: {counters}"
        if not stacks:
            return [line]
        # What is P busy with? Its processes' busiest threads over one short window,
        # then where each thread of each is: the Python stacks they dump on request, and
        # the native ones (a wait inside a transport library).
        every = [proc.pid, *pids]
        threads = [f"{pid}: {shown}" for pid, shown in busy_threads(every).items()]
        return [
            line,
            "P threads (name, state, CPU share): " + "; ".join(threads),
            *(f"P stack: {s}" for s in self._p_stacks(proc, every)),
            *(f"P native: {s}" for pid in every for s in native_stacks(pid)),
        ]

    @staticmethod
    def _p_stacks(proc: PeerProcess, pids: list[int]) -> list[str]:
        """Ask P and its ranks for their Python stacks (:data:`STACK_SIGNAL`) and read
        them from P's stderr, one line per thread, led by the process's pid.

        One process at a time: they share P's stderr, and dumps written together
        interleave line by line. Each gets at most :data:`P_STACKS_WAIT_S`, and is done
        once its output stops growing."""
        out: list[str] = []
        for pid in pids:
            marker = proc.output_marker()
            try:
                os.kill(pid, STACK_SIGNAL)
            except OSError:
                continue
            deadline = time.monotonic() + P_STACKS_WAIT_S
            seen = -1
            while time.monotonic() < deadline:
                time.sleep(0.1)
                lines = len(proc.output_since(marker, stdout=False))
                if lines and lines == seen:
                    break
                seen = lines
            dump = summarize_stacks(proc.output_since(marker, stdout=False))
            out += [f"{pid} {thread}" for thread in dump]
        return out[:P_STACKS_MAX]
