"""Stepping a pair's D until something holds: a warm D, a condition, P's sends over.

Apart from :mod:`kvfail.peers.base` because waiting is a job of its own: every wait here
steps D and observes each step as the suite does (so reports are stamped and the
integrity oracle watches), bounded by a deadline, whatever the transport. The pair
supplies the engines, P and the requests (:class:`~kvfail.peers.base.PeerPair`).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfail.harness import Engine
    from kvfail.peers.decode_record import DecodeRecord

__all__ = ["PairStepping", "all_blocks_free", "quarantined"]

#: How often a wait asks P (a protocol round trip) while it steps D.
_ASK_P_EVERY_S = 0.1

#: Warm-up pulls' ids: unique in the process, as a P shared by several pairs must never
#: see an id twice.
_WARM_SEQ = itertools.count(1)


def quarantined(engine: Engine) -> dict[str, int]:
    """D's scheduler-side quarantine: held loads and blocks (empty for a D without one)."""
    quarantine = getattr(engine.scheduler.connector, "quarantine", None)
    if quarantine is None:
        return {"loads": 0, "blocks": 0}
    return {"loads": len(quarantine), "blocks": quarantine.blocks_held}


def all_blocks_free(engine: Engine) -> bool:
    """Every block of D's pool is free again (the null block never is)."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    return bool(pool.get_num_free_blocks() == engine.spec.num_blocks - 1)


class PairStepping:
    """The waiting half of :class:`~kvfail.peers.base.PeerPair`, which supplies what is
    declared below (and ``run``, each transport's own)."""

    records: dict[str, DecodeRecord]

    if TYPE_CHECKING:

        def _engine(self, consumer: str | Engine | None) -> Engine: ...

        def _ready_producer(self) -> Any: ...

        def observe(self, engine: Engine) -> None: ...

        def verify(self, req_id: str) -> bool: ...

        def prefill_and_add(
            self, req_id: str, prompt_len: int = 100, *, consumer: str | Engine | None = None
        ) -> Any: ...

    def warm(
        self,
        consumer: str | Engine | None = None,
        *,
        within_s: float = 0.0,
        timeout_s: float = 30.0,
    ) -> str:
        """Loads from P into ``consumer`` until one verifies, so it is a warm D (it has
        P's address and transport endpoints, and a handshake is out of what it measures
        next). Returns the id of the load that verified.

        A cold first load includes the handshake, which a short deadline may fail on a
        loaded machine: D reporting it failed is its connector doing its job, so the
        load is tried again once D has every block back (a held load keeps them until P
        can no longer write), for as long as ``within_s`` allows (the default: one load).
        ``RuntimeError`` once that has passed, and at once for what no handshake
        explains: a load D did not end within ``timeout_s``, or one reported loaded
        without P's exact bytes."""
        engine = self._engine(consumer)
        end = time.monotonic() + within_s
        tries = 0
        while True:
            tries += 1
            rid = f"warm-{os.getpid()}-{next(_WARM_SEQ)}"
            self.prefill_and_add(rid, prompt_len=40, consumer=engine)
            run = self.run([rid], consumer=engine, timeout_s=timeout_s)  # type: ignore[attr-defined]
            record = self.records[rid]
            if not run.ok:
                raise RuntimeError(f"warm-up load {rid} did not end ({run}, {record})")
            if not record.failed:
                if self.verify(rid):
                    return rid
                raise RuntimeError(f"warm-up load {rid} loaded without P's bytes ({record})")
            left = end - time.monotonic()
            if left <= 0 or not self.step_until(engine, lambda: all_blocks_free(engine), left):
                raise RuntimeError(
                    f"no verified load from P for {consumer!r} within {within_s}s "
                    f"({tries} tries, the last {record})"
                )

    def step_until(
        self,
        engine: Engine,
        done: Callable[[], bool],
        timeout_s: float,
        *,
        ask_every_s: float = 0.0,
    ) -> bool:
        """Step D ``engine``, observing each step as the suite does, until ``done()``;
        False if ``timeout_s`` passed first. ``ask_every_s``: ask ``done`` at most that
        often (and once more at the end), for a question that costs a round trip to P
        or a look at every rank's blocks."""
        end = time.monotonic() + timeout_s
        asked = -math.inf
        while True:
            now = time.monotonic()
            if now - asked >= ask_every_s or now >= end:
                asked = now
                if done():
                    return True
            if now >= end:
                return False
            engine.step()
            self.observe(engine)
            time.sleep(0.005)

    def wait_finished_sending(
        self, engine: Engine, req_ids: Iterable[str], timeout_s: float
    ) -> bool:
        """Whether P reported every one of ``req_ids`` sent (its writes over, its blocks
        let go) within ``timeout_s``, stepping D ``engine`` meanwhile: D's own step may be
        what tells P (NIXL's completion notification), and a D left idle would have P let
        go only at its lease's end, which says nothing of the writes."""
        producer = self._ready_producer()
        wanted = set(req_ids)
        return self.step_until(
            engine,
            lambda: wanted <= set(producer.stats()["finished_sending"]),
            timeout_s,
            ask_every_s=_ASK_P_EVERY_S,
        )
