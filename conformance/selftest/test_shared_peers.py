"""P hand-off between drivers: a driver that stops leaves its healthy P to the session's
registry (the next driver wanting the same P starts warm); a frozen, dead or second P is
closed as before, and the registry closes what is left at the session's end. A pair's
own second P (``kill_one_peer``) lives for one scenario only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance import peer_health
from kvfail.conformance import shared_producers as drivers
from kvfail.conformance.nixl_driver import NixlDriver
from kvfail.peers.base import PeerPair


class _Proc:
    def __init__(self, alive: bool = True, frozen: bool = False) -> None:
        self.alive, self.frozen = alive, frozen


class _Producer:
    """A P that never started its engine (``ready`` None: never probed as crashed)."""

    def __init__(self, **state: bool) -> None:
        self.process = _Proc(**state)
        self.ready = None
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.process.alive = False


class _Pair:
    def __init__(self, producer: _Producer, owns: bool = True, key: str = "k") -> None:
        self.p, self.owns_p, self.kvfail_share_key = producer, owns, key

    def close(self) -> None:
        if self.owns_p:
            self.p.close()


@pytest.fixture
def registry() -> Iterator[dict[str, Any]]:
    saved = dict(drivers._SHARED_P)
    drivers._SHARED_P.clear()
    yield drivers._SHARED_P
    drivers._SHARED_P.clear()
    drivers._SHARED_P.update(saved)


def _stop(pair: _Pair) -> None:
    driver = NixlDriver("nixl-test")
    assert driver.hand_off_p
    driver._pair = pair
    driver.stop()


def test_a_healthy_own_p_is_handed_off_and_closed_at_the_end(
    registry: dict[str, Any],
) -> None:
    p = _Producer()
    _stop(_Pair(p))
    assert not p.closed and drivers.shared_producer("k") is p
    drivers.close_shared_producers()
    assert p.closed and not registry


@pytest.mark.parametrize("state", [{"frozen": True}, {"alive": False}])
def test_a_frozen_or_dead_p_is_never_handed_off(
    registry: dict[str, Any], state: dict[str, bool]
) -> None:
    p = _Producer(**state)
    _stop(_Pair(p))
    assert drivers.shared_producer("k") is None


def test_a_borrowed_p_stays_registered_and_a_second_own_p_is_closed(
    registry: dict[str, Any],
) -> None:
    first, second = _Producer(), _Producer()
    registry["k"] = first
    _stop(_Pair(first, owns=False))
    assert not first.closed and drivers.shared_producer("k") is first
    _stop(_Pair(second))
    assert second.closed and drivers.shared_producer("k") is first


def test_a_dead_p_is_replaced_by_the_registered_replacement_first(
    registry: dict[str, Any],
) -> None:
    """Two drivers pulling from one P: when a scenario kills it, the first driver to need
    a P starts (and registers) one; the other borrows that one instead of a third."""
    started: list[_Producer] = []

    class _Restartable(_Pair):
        ready_timeout_s = 1.0

        def restart_p(self, *, wait: bool = True) -> None:
            self.p, self.owns_p = _Producer(), True
            started.append(self.p)

    dead = _Producer(alive=False)
    a, b = _Restartable(dead, owns=False), _Restartable(dead, owns=False)
    driver = NixlDriver("nixl-test")
    driver._replace_p(a)
    assert started == [a.p] and a.owns_p and drivers.shared_producer("k") is a.p
    driver._replace_p(b)
    assert started == [a.p] and b.p is a.p and not b.owns_p


def test_a_handed_off_p_a_borrower_killed_is_closed_when_its_replacement_registers(
    registry: dict[str, Any],
) -> None:
    """Nobody owns a P a stopped driver handed off: the borrower that killed it starts its
    own, and registering that one closes the dead P (else it outlives every owner)."""
    handed = _Producer()
    _stop(_Pair(handed))
    handed.process.alive = False  # a borrower's scenario killed it

    class _Restartable(_Pair):
        ready_timeout_s = 1.0

        def restart_p(self, *, wait: bool = True) -> None:
            self.p, self.owns_p = _Producer(), True

    borrower = _Restartable(handed, owns=False)
    NixlDriver("nixl-test")._replace_p(borrower)
    assert handed.closed and drivers.shared_producer("k") is borrower.p


def test_an_own_dead_p_is_closed_when_the_pair_borrows_a_replacement(
    registry: dict[str, Any],
) -> None:
    own, replacement = _Producer(), _Producer()
    own.process.alive = False
    registry["k"] = replacement
    pair = _Pair(own)
    NixlDriver("nixl-test")._replace_p(pair)
    assert own.closed and pair.p is replacement and not pair.owns_p


class _ReadyProducer(_Producer):
    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        return {}


class _TwoPPair(PeerPair):
    """A pair whose second P's are fakes (the real ones are real processes)."""

    ready_timeout_s = 1.0

    def __init__(self) -> None:
        self._init_common()
        self.started: list[_ReadyProducer] = []

    def _new_producer(self) -> _ReadyProducer:
        self.started.append(_ReadyProducer())
        return self.started[-1]


def test_a_second_p_is_reused_while_alive_replaced_once_dead_and_closed_after_the_scenario(
    registry: dict[str, Any],
) -> None:
    """Why: a second P left running would idle through the rest of the session, and a
    later scenario would inherit a peer it never asked for."""
    pair = _TwoPPair()
    first = pair.second_p()
    assert pair.second_p() is first
    first.process.alive = False  # the scenario SIGKILLed it
    second = pair.second_p()
    assert pair.started == [first, second] and first.closed
    driver = NixlDriver("nixl-test")
    driver._pair = pair
    driver.after_scenario()
    assert second.closed and pair.p2 is None
    assert drivers.shared_producer("k") is None  # never offered to other drivers


# --------------------------------------------------------------------------- wedged P

_SPIN = "import threading, time\ndef loop():\n    while True:\n        pass\n"
_SPIN += "threading.Thread(target=loop, daemon=True).start()\ntime.sleep(120)\n"
_IDLE = "import time\ntime.sleep(120)\n"


class _LiveProducer(_ReadyProducer):
    """A P whose process is real (a thread that spins, or nothing running)."""

    def __init__(self, code: str) -> None:
        import sys

        from kvfail.rig.processes import PeerProcess

        super().__init__()
        self.process = PeerProcess([sys.executable, "-c", code], name="wedge-test-p")
        self.ready = {"rank_pids": []}

    def stats(self, timeout_s: float) -> dict[str, Any]:
        return {}  # its engine answers: never "crashed"

    def close(self) -> None:
        self.closed = True
        self.process.close(grace_s=0.2)


class _OnePPair(PeerPair):
    ready_timeout_s = 1.0
    kill_timeout_s = 5.0
    kvfail_share_key = None

    def __init__(self, producer: _Producer) -> None:
        self._init_common()
        self.p = producer
        self.restarts = 0

    def restart_p(self, *, wait: bool = True) -> None:
        self.p = None  # the next P would start here; none is needed
        self.restarts += 1


@pytest.mark.parametrize(
    ("code", "failed", "replaced"),
    [(_SPIN, True, True), (_SPIN, False, False), (_IDLE, True, False)],
    ids=["spinning-after-a-failure", "spinning-after-a-pass", "idle-after-a-failure"],
)
def test_a_p_spinning_after_a_failed_scenario_is_replaced(
    registry: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    code: str,
    failed: bool,
    replaced: bool,
) -> None:
    """Why: a P whose transport thread is stuck in a loop answers its stats yet never
    writes again, and every later scenario that used it would fail too. Only after a
    failed scenario (a pass costs nothing), only a P with a thread that spins. A low share
    keeps the test about which P is replaced, not how fast a loaded machine runs it."""
    monkeypatch.setattr(peer_health, "SPIN_SHARE", 0.25)
    producer = _LiveProducer(code)
    try:
        pair = _OnePPair(producer)
        driver = NixlDriver("nixl-test")
        driver._pair = pair
        if code is _SPIN:  # the thread has started: the process has two threads
            import os
            import time

            end = time.monotonic() + 10
            while len(os.listdir(f"/proc/{producer.process.pid}/task")) < 2:
                assert time.monotonic() < end
                time.sleep(0.01)
        if failed:
            driver.scenario_failed()
        driver.after_scenario()
        assert (not producer.process.alive) is replaced
        assert pair.restarts == int(replaced)
        notes = driver._driver_notes
        assert bool(notes) is replaced, notes
        if replaced:
            assert f"P pid {producer.process.pid} replaced after a failed scenario" in notes[0]
    finally:
        producer.close()


class _WritingProducer(_LiveProducer):
    """An idle P process whose stats report a write into D under way for ``write_s``."""

    def __init__(self, write_s: float) -> None:
        super().__init__(_IDLE)
        self.write_s = write_s

    def stats(self, timeout_s: float) -> dict[str, Any]:
        return {"oldest_write_s": self.write_s}


@pytest.mark.parametrize(
    ("over", "replaced"), [(True, True), (False, False)], ids=["stuck-write", "short-write"]
)
def test_a_p_with_a_write_stuck_past_the_bound_is_replaced_even_after_a_pass(
    registry: dict[str, Any], over: bool, replaced: bool
) -> None:
    """Why: a P whose transfer engine wedged inside a write (Mooncake's transport thread
    spinning in its timer queue) answers its stats but never serves a pull again; its
    stuck write is the evidence, so it goes after any scenario, before the next one
    fails on it. A write still under way but within the bound is a working P."""
    bound = peer_health.WEDGED_WRITE_S
    producer = _WritingProducer(bound * 2 if over else bound / 10)
    try:
        pair = _OnePPair(producer)
        driver = NixlDriver("nixl-test")
        driver._pair = pair
        driver.after_scenario()  # the scenario passed
        assert (not producer.process.alive) is replaced
        assert pair.restarts == int(replaced)
    finally:
        producer.close()
