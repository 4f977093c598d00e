"""The rig's Mooncake P writes into D once more when a write fails
(``kvfail.peers.producer.WRITE_RETRIES``, rig patch ``mooncake_p_peer_caches``).

Why: P keeps Mooncake's pooled connections (without the pool, Mooncake's own threads race
on a timer and wedge P's transfer engine), and the suite's D engines come and go on
reused ports, so a pooled connection can lead to an ended D; the first write on it fails.
Here the transfer engine's write is scripted (a double at the transport boundary: the
method under the rig's wrapper); the real one runs under every Mooncake scenario of the
suite, and ``bench.mooncake_peer_caches`` counts lost writes over real engines.
"""

from __future__ import annotations

from typing import Any

from kvfail.peers.producer import WRITE_RETRIES, _FaultInjectingSender


class _ScriptedTransport:
    """Answers each write with the next scripted return code (0: written)."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = list(codes)
        self.writes: list[tuple[str, list[int]]] = []

    def _send_blocks(
        self, remote_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]
    ) -> int:
        self.writes.append((remote_session, list(dst_ptrs)))
        return self.codes.pop(0)


class _Sender(_FaultInjectingSender, _ScriptedTransport):
    pass


def _write(codes: list[int]) -> tuple[int, _Sender]:
    sender = _Sender(codes)
    return sender._send_blocks("127.0.0.1:15000", [1, 2], [10, 20], [4, 4]), sender


def test_a_write_that_lands_is_not_repeated() -> None:
    ret, sender = _write([0])
    assert ret == 0 and len(sender.writes) == 1
    assert getattr(sender, "kvfail_write_retries", 0) == 0


def test_a_failed_write_is_written_again_to_the_same_place() -> None:
    ret, sender = _write([-1, 0])
    assert ret == 0
    assert sender.writes == [("127.0.0.1:15000", [10, 20])] * 2
    assert sender.kvfail_write_retries == 1


def test_a_write_that_keeps_failing_is_reported_failed_after_the_retries() -> None:
    ret, sender = _write([-1] * (WRITE_RETRIES + 2))
    assert ret == -1
    assert len(sender.writes) == WRITE_RETRIES + 1
    assert sender.kvfail_write_retries == WRITE_RETRIES


def test_a_write_under_way_shows_in_the_stats_until_it_returns() -> None:
    """What marks a wedged transfer engine (``oldest_write_s``, read by the pair driver):
    a write that has not returned. Ordered, not timed: under way it has an age, after it
    returns there is none."""
    import threading
    from types import SimpleNamespace

    from kvfail.peers.producer import _oldest_write_s

    entered, release = threading.Event(), threading.Event()

    class _Blocking:
        def _send_blocks(self, *args: object) -> int:
            entered.set()
            assert release.wait(30)
            return 0

    class _BlockingSender(_FaultInjectingSender, _Blocking):
        pass

    sender = _BlockingSender()
    view: Any = SimpleNamespace(connector=SimpleNamespace(connector_worker=sender))
    writer = threading.Thread(target=sender._send_blocks, args=("s", [1], [2], [3]))
    writer.start()
    try:
        assert entered.wait(30)
        age = _oldest_write_s(view)
        assert age is not None and age >= 0
    finally:
        release.set()
        writer.join(30)
    assert not writer.is_alive() and _oldest_write_s(view) is None
