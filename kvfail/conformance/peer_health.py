"""How the pair drivers judge their P's between scenarios, and what of a P's output a
failed scenario shows.

Why apart from the driver: a P shared across scenarios must be replaced once it is
unsound (its engine crashed, a write stuck, a thread spinning while idle), or one failure
would fail every scenario after it; and a verdict's evidence is the P's own error lines.
Both read the P processes only; neither drives D.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfail.peers.base import PeerPair
    from kvfail.rig.processes import PeerProcess

__all__ = [
    "PEER_OUTPUT_LINES",
    "SPIN_SHARE",
    "SPIN_WINDOW_S",
    "WEDGED_WRITE_S",
    "notable_output",
    "p_unsound",
    "producers",
    "spinning_ps",
]

logger = logging.getLogger("kvfail.conformance")

#: After a failed scenario, a P thread using this share of a core over
#: :data:`SPIN_WINDOW_S`, with no scenario running, marks that P as wedged (a transport
#: thread stuck in a loop: a Mooncake transfer engine spinning in its timer queue after a
#: sibling rank died never wrote again). Such a P is replaced, so one failure cannot
#: fail the scenarios after it.
SPIN_SHARE = 0.8
SPIN_WINDOW_S = 0.5
#: A P whose stats show a write into D under way for longer than this (``oldest_write_s``:
#: a loopback write takes milliseconds) has a wedged transfer engine: it is replaced
#: after the scenario, passed or failed, as a P that lost its engine is.
WEDGED_WRITE_S = 10.0


#: A failing scenario shows at most this many of each P's error-looking lines.
PEER_OUTPUT_LINES = 15
#: What an error-looking line of a P's output is: vLLM's, UCX's and glog's error and
#: warning marks, and Python's tracebacks.
_NOTABLE_OUTPUT = re.compile(r"error|fail|traceback|exception|warn|^[EWF]\d{4} ", re.IGNORECASE)


def p_unsound(pair: PeerPair) -> bool:
    """P's process lives but its engine crashed (a rank died), its transfer engine is
    wedged (a write stuck past :data:`WEDGED_WRITE_S`), or it does not answer."""
    if pair.p is None or pair.p.ready is None:
        return False  # still starting: not known yet
    try:
        stats = pair.p.stats(timeout_s=10.0)
    except Exception:
        return True
    if stats.get("oldest_write_s", 0.0) > WEDGED_WRITE_S:
        logger.warning(
            "kvfail: P pid %s replaced: a write into D under way for %s s",
            pair.p.process.pid,
            stats["oldest_write_s"],
        )
        return True
    return stats.get("crashed") is not None


def producers(pairs: Iterable[PeerPair]) -> list[PeerProcess]:
    """Every P process of ``pairs`` (first and second P)."""
    return [
        producer.process for pair in pairs for producer in (pair.p, pair.p2) if producer is not None
    ]


def spinning_ps(pairs: Iterable[PeerPair]) -> dict[int, str]:
    """The live P's of ``pairs`` with a thread spinning while no scenario runs (their
    processes' and their ranks' threads, one common window): P pid -> the threads."""
    from kvfail.rig.procfs import spinning_threads

    owner: dict[int, int] = {}
    for pair in pairs:
        producer = pair.p
        if producer is None or not producer.process.alive or producer.process.frozen:
            continue
        ranks = (producer.ready or {}).get("rank_pids", [])
        for pid in (producer.process.pid, *ranks):
            owner[int(pid)] = producer.process.pid
    out: dict[int, list[str]] = {}
    for pid, threads in spinning_threads(sorted(owner), SPIN_WINDOW_S, SPIN_SHARE).items():
        out.setdefault(owner[pid], []).extend(threads)
    return {pid: ", ".join(threads) for pid, threads in out.items()}


def notable_output(procs: Iterable[PeerProcess], marks: Mapping[int, tuple[int, int]]) -> list[str]:
    """Each P's error-looking lines since its mark in ``marks`` (a P started since: all of
    them), the last :data:`PEER_OUTPUT_LINES` of each. stderr only: a P's stdout carries
    its protocol replies, not its logs."""
    out: list[str] = []
    for proc in procs:
        lines = proc.output_since(marks.get(proc.pid, (0, 0)), stdout=False)
        notable = [ln for ln in lines if _NOTABLE_OUTPUT.search(ln)]
        out += [f"[{proc.name} pid {proc.pid}] {ln}" for ln in notable[-PEER_OUTPUT_LINES:]]
    return out
