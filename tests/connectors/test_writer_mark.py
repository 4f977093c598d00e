"""The writer mark and the Mooncake watch's two verdicts, on real sockets.

Why real sockets: the watch's claims rest on what the kernel answers. A closed TCP
listener refuses connects; an unbound UDP port answers with port unreachable, which a
connected UDP socket reads as ``ECONNREFUSED``. Each test builds the shapes a P worker
goes through with real listeners on loopback (IPv4 and IPv6): alive, side channel closed
while the writer still runs (a graceful shutdown), writer gone, a new writer at the same
address (a restart), and a P with no mark at all (upstream's).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from connectors.mooncake.probe import (
    MarkBook,
    MarkSeen,
    PullWriter,
    refused_before_send,
    watch_side_channel,
)
from connectors.writer_mark import WriterMark, ask_writer_mark, start_writer_mark

#: Bound on every wait here; far above a loopback round trip.
WAIT_S = 10.0
INTERVAL_S = 0.02


def _free_port(host: str) -> int:
    """A port free for both TCP and UDP on ``host`` (the mark shares the side channel's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50):
        with socket.socket(family, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as udp:
                    udp.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free for TCP and UDP")


@contextmanager
def _listener(host: str, port: int) -> Iterator[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(8)
    try:
        yield sock
    finally:
        sock.close()


def _addr(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Verdicts:
    """What a watch reported, and the writers of the pulls it watches, kept as D's worker
    keeps them: a pull whose writer is proven gone leaves the list."""

    def __init__(self) -> None:
        self.lost: list[str] = []
        self.gone: list[str] = []
        self.writers: list[PullWriter] = []

    def send(self, marks: MarkBook, addr: str) -> PullWriter:
        """A pull leaves D for ``addr``."""
        writer = marks.writer_for(addr)
        self.writers.append(writer)
        return writer

    def ended(self, reason: str, ended: list[PullWriter]) -> None:
        self.gone.append(reason)
        self.writers = [w for w in self.writers if w not in ended]

    def stop(self) -> None:
        self.writers = []


def _fresh(host: str = "127.0.0.1") -> tuple[str, int, _Verdicts, MarkBook]:
    """A P worker's address to build on, and D's empty view of it."""
    return host, _free_port(host), _Verdicts(), MarkBook()


async def _reaches(host: str, port: int, marks: MarkBook) -> None:
    """D's check before a pull leaves: the worker takes it (its mark, if any, recorded)."""
    assert await refused_before_send(_addr(host, port), marks) is None


@asynccontextmanager
async def _seen_then_closed(host: str, port: int, marks: MarkBook) -> AsyncIterator[WriterMark]:
    """A P worker whose mark D saw before a pull, then gone (its mark closed) while its
    side channel still listens: how the restart-on-the-same-address cases begin."""
    old = WriterMark(host, port)
    with _listener(host, port):
        await _reaches(host, port, marks)
        old.close()
        yield old


async def _no_proof_until_closed(
    task: asyncio.Task[None], seen: _Verdicts, mark: WriterMark, ready: Callable[[], bool]
) -> None:
    """Once ``ready()``, many watch rounds with ``mark``'s writer alive prove nothing;
    then the mark closes, and the watch ends on that proof."""
    try:
        await _until(ready)
        for _ in range(20):
            await asyncio.sleep(INTERVAL_S)
        assert seen.gone == [] and not task.done()
    finally:
        mark.close()
    await asyncio.wait_for(task, WAIT_S)


async def _until(predicate: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), WAIT_S)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


HOSTS = [
    "127.0.0.1",
    pytest.param(
        "::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="requires IPv6 loopback")
    ),
]


@pytest.mark.parametrize("host", HOSTS)
def test_mark_answers_with_its_nonce_until_closed(host: str) -> None:
    port = _free_port(host)
    mark = WriterMark(host, port)
    try:
        answer, nonce = asyncio.run(ask_writer_mark(host, port, WAIT_S))
        assert (answer, nonce) == ("alive", mark.nonce)
    finally:
        mark.close()
    assert asyncio.run(ask_writer_mark(host, port, WAIT_S)) == ("refused", None)


def test_mark_ignores_strangers_and_bad_names(unresolvable_name: str) -> None:
    port = _free_port("127.0.0.1")
    mark = WriterMark("127.0.0.1", port)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            stranger.settimeout(0.3)
            stranger.sendto(b"hello", ("127.0.0.1", port))
            with pytest.raises(TimeoutError):
                stranger.recvfrom(64)
        # A name that does not resolve proves nothing, and never raises.
        assert asyncio.run(ask_writer_mark(unresolvable_name, port, 2.0)) == (
            "unknown",
            None,
        )
    finally:
        mark.close()


def test_a_port_taken_gives_no_mark() -> None:
    port = _free_port("127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(("127.0.0.1", port))
        assert start_writer_mark("127.0.0.1", port) is None


async def _watch(host: str, port: int, seen: _Verdicts, marks: MarkBook) -> None:
    """Send a pull to the worker (unless the test sent its own), then watch it."""
    addr = _addr(host, port)
    if not seen.writers:
        seen.send(marks, addr)
    await watch_side_channel(
        addr,
        INTERVAL_S,
        writers=lambda: seen.writers,
        lost=seen.lost.append,
        gone=seen.ended,
        marks=marks,
    )


@pytest.mark.parametrize("host", HOSTS)
def test_side_channel_closed_before_the_writer_is_lost_not_gone(host: str) -> None:
    """A graceful shutdown: the side channel closes while the writer still runs. The
    watch reports the worker lost (fail now) but not gone (blocks stay held) until the
    mark closes."""
    host, port, seen, marks = _fresh(host)

    async def scenario() -> None:
        mark = WriterMark(host, port)
        with _listener(host, port):
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await _until(lambda: _addr(host, port) in marks)
        await _no_proof_until_closed(task, seen, mark, lambda: bool(seen.lost))

    asyncio.run(scenario())
    assert len(seen.lost) == 1 and "side channel refused" in seen.lost[0]
    assert len(seen.gone) == 1 and "writer mark refused" in seen.gone[0]


def test_a_new_writer_at_the_same_address_proves_the_old_one_gone() -> None:
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        old = WriterMark(host, port)
        with _listener(host, port) as first:
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await _until(lambda: marks.get(_addr(host, port)) == old.nonce)
            old.close()
            new = WriterMark(host, port)
            first.close()  # the held connection ends: the watch asks the mark again
            try:
                await asyncio.wait_for(task, WAIT_S)
            finally:
                new.close()

    asyncio.run(scenario())
    assert len(seen.gone) == 1 and "restarted" in seen.gone[0]


def test_a_p_with_no_mark_is_lost_but_never_proven_gone() -> None:
    """Upstream's P has no mark: its side channel refusing fails the loads, and nothing
    ever proves its writes over (the holds wait for P's answer or the max hold)."""
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        with _listener(host, port):
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await asyncio.sleep(5 * INTERVAL_S)
        await _until(lambda: bool(seen.lost))
        for _ in range(20):
            await asyncio.sleep(INTERVAL_S)
        seen.stop()
        await asyncio.wait_for(task, WAIT_S)

    asyncio.run(scenario())
    assert len(seen.lost) == 1 and seen.gone == [] and marks == {}


def test_a_killed_writer_is_gone_without_a_lost_first() -> None:
    """Side channel and mark close together (SIGKILL): one verdict, gone."""
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        mark = WriterMark(host, port)
        with _listener(host, port):
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await _until(lambda: _addr(host, port) in marks)
            mark.close()
        await asyncio.wait_for(task, WAIT_S)

    asyncio.run(scenario())
    assert len(seen.gone) == 1 and "writer mark refused" in seen.gone[0]


def test_a_worker_refusing_before_the_pull_is_sent_never_got_it() -> None:
    """Checked before the pull leaves D: a side channel that refuses proves, for any P,
    that nothing reached the worker; one that accepts lets the pull go ahead."""
    host = "127.0.0.1"
    port = _free_port(host)
    marks = MarkBook()
    with _listener(host, port):
        assert asyncio.run(refused_before_send(_addr(host, port), marks)) is None
    assert marks == {}  # no mark there (an upstream P): nothing recorded
    reason = asyncio.run(refused_before_send(_addr(host, port), marks))
    assert reason is not None and "before the pull was sent" in reason
    assert asyncio.run(refused_before_send("ipc:///tmp/not-tcp", marks)) is None


def test_a_writer_dead_before_the_watch_first_asks_is_proven_gone() -> None:
    """The mark is asked before the pull is sent: a P that takes the pull and dies before
    the watch's first round is still proven gone. Without the nonce seen first, its
    refusal would prove nothing (a P with no mark refuses the same way) and the load's
    blocks would stay held for good."""
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        mark = WriterMark(host, port)
        with _listener(host, port):
            await _reaches(host, port, marks)
            assert marks == {_addr(host, port): mark.nonce}
            mark.close()  # SIGKILL between the send and the watch's first round
        await asyncio.wait_for(_watch(host, port, seen, marks), WAIT_S)

    asyncio.run(scenario())
    assert len(seen.gone) == 1 and "writer mark refused" in seen.gone[0]


def test_a_restart_while_nothing_was_watched_is_not_taken_for_the_next_writers_end() -> None:
    """P restarts on the same address while D watches nothing there. The mark asked
    before the next pull records the new writer, so the watch does not read its nonce
    as proof that this pull's writer is gone (the blocks would be freed while it writes)."""
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        async with _seen_then_closed(host, port, marks):
            new = WriterMark(host, port)  # restarted on the same address, unseen
            try:
                await _reaches(host, port, marks)
                assert marks == {_addr(host, port): new.nonce}
                task = asyncio.create_task(_watch(host, port, seen, marks))
                await asyncio.sleep(10 * INTERVAL_S)
                seen.stop()
                await asyncio.wait_for(task, WAIT_S)
            finally:
                new.close()

    asyncio.run(scenario())
    assert seen.gone == [] and seen.lost == []


def test_a_mark_silent_before_the_pull_proves_nothing_by_a_new_nonce() -> None:
    """Before the pull, the mark D saw earlier does not answer (a stopped P, or one
    restarted unseen and busy). A new nonce later may be the pull's own writer: no proof.
    A refusal still is: no mark is bound there, so whichever wrote is gone."""
    host, port, seen, marks = _fresh()

    async def scenario() -> None:
        async with _seen_then_closed(host, port, marks) as old:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
                silent.bind((host, port))  # bound, never answers: a stopped P's mark
                await _reaches(host, port, marks)
            assert marks == {_addr(host, port): old.nonce}
            new = WriterMark(host, port)  # the writer that answers after the pull
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await _no_proof_until_closed(
                task, seen, new, lambda: marks.get(_addr(host, port)) == new.nonce
            )

    asyncio.run(scenario())
    assert len(seen.gone) == 1 and "writer mark refused" in seen.gone[0]


def test_a_writer_proven_gone_is_gone_for_a_pull_that_registers_after_the_proof() -> None:
    """A pull's pre-send check sees the writer's nonce; while it waits, P dies and the
    watch of the other pulls proves it and ends. The pull then registers and starts a
    watch of its own: the same death must prove its writes over too. Seen in the e2e
    tier (P killed mid-run): the first watch dropped the nonce, the second could only
    report the side channel refusing, and the pull's blocks stayed held for good."""
    host, port, first, marks = _fresh()
    late = _Verdicts()

    async def scenario() -> None:
        mark = WriterMark(host, port)
        with _listener(host, port):
            await _reaches(host, port, marks)
        mark.close()  # SIGKILL: the side channel and the mark close together
        await asyncio.wait_for(_watch(host, port, first, marks), WAIT_S)
        await asyncio.wait_for(_watch(host, port, late, marks), WAIT_S)

    asyncio.run(scenario())
    assert len(first.gone) == 1 and "writer mark refused" in first.gone[0]
    assert late.lost == [] and len(late.gone) == 1 and "writer mark refused" in late.gone[0]


def test_a_p_that_dies_between_connect_and_mark_ask_is_not_sent_the_pull(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pre-send connect is accepted, then P dies before its mark is asked: the mark
    refuses as an upstream P's would. The side channel, asked again, refuses too, so the
    pull is not sent (nothing reached P) instead of going to a P that no watch could
    prove gone (its nonce was never seen)."""
    import connectors.mooncake.probe as probe

    host = "127.0.0.1"
    port = _free_port(host)
    marks = MarkBook()
    mark = WriterMark(host, port)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(8)
    real_ask = probe.ask_writer_mark

    async def dies_first(*args: object, **kwargs: object) -> tuple[str, bytes | None]:
        listener.close()  # SIGKILL between the connect and the ask
        mark.close()
        return await real_ask(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(probe, "ask_writer_mark", dies_first)
    try:
        reason = asyncio.run(refused_before_send(_addr(host, port), marks))
    finally:
        listener.close()
        mark.close()
    assert reason is not None and "before the pull was sent" in reason
    assert marks == {}


def test_a_round_begun_before_the_pull_left_does_not_judge_it() -> None:
    """A mark asked before the pull left may have been asked before its writer bound the
    address: neither its refusal nor its nonce says anything of that writer. The first
    later round that hears a nonce makes it the pull's writer; after that, another nonce
    or a refusal proves it gone."""
    marks = MarkBook()
    addr = "tcp://127.0.0.1:1"
    marks.saw(addr, b"old")
    early = marks.begin_round(addr)
    writer = marks.writer_for(addr)
    assert not writer.ended_by(MarkSeen(None, early))
    assert not writer.ended_by(MarkSeen(b"new", early))
    assert not writer.ended_by(MarkSeen(b"new", marks.begin_round(addr)))  # confirms "new"
    assert (writer.nonce, writer.confirmed) == (b"new", True)
    assert not writer.ended_by(MarkSeen(b"new", marks.begin_round(addr)))
    assert writer.ended_by(MarkSeen(b"newer", marks.begin_round(addr)))
    assert writer.ended_by(MarkSeen(None, marks.begin_round(addr)))
    # No mark ever seen (an upstream P): a refusal proves nothing.
    assert not PullWriter().ended_by(MarkSeen(None, 1))


def test_a_pull_sent_while_watched_to_a_restarted_p_keeps_its_hold() -> None:
    """P restarts at the same address between two rounds of a running watch, and a pull
    leaves D for the new P meanwhile (no mark is asked on the pull's path while a watch
    runs). The new nonce proves the old writer gone, and only the old writer's pulls
    end: the new pull's hold stays until its own writer is gone. An address-wide verdict
    freed the new pull's blocks while the new P could write them."""
    host, port, seen, marks = _fresh()
    addr = _addr(host, port)

    async def scenario() -> None:
        old = WriterMark(host, port)
        with _listener(host, port):
            assert await refused_before_send(addr, marks) is None
            first = seen.send(marks, addr)
            task = asyncio.create_task(_watch(host, port, seen, marks))
            await _until(lambda: first.confirmed)
            # No await from here to the send: the watch cannot run in between.
            old.close()
            new = WriterMark(host, port)
            second = seen.send(marks, addr)
            try:
                await _until(lambda: bool(seen.gone))
                assert seen.writers == [second] and "restarted" in seen.gone[0]
                await _until(lambda: second.confirmed)
                for _ in range(10):  # many rounds: the new writer answers, no proof
                    await asyncio.sleep(INTERVAL_S)
                assert len(seen.gone) == 1 and not task.done()
                assert second.nonce == new.nonce
            finally:
                new.close()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(scenario())
    assert len(seen.gone) == 2 and "writer mark refused" in seen.gone[1]
    assert seen.writers == [] and seen.lost == []
