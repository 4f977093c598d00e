"""8 reporting threads and 1 draining thread: nothing lost, nothing duplicated."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from kvfail import LoadTracker, Stage

N_THREADS = 8
PER_THREAD = 1500
PEERS = 3


@pytest.mark.usefixtures("quiet_kvfail_logs")
def test_concurrent_reports_and_drains_lose_and_duplicate_nothing() -> None:
    total = N_THREADS * PER_THREAD
    # Every id stays "recent" for the whole test: a reporter thread starved on a loaded
    # machine may send its duplicate after thousands of other deliveries, and past the
    # default memory it is counted as unknown instead of late, which is the bound working,
    # not a lost or doubled delivery (the accounting below counts exactly).
    tracker = LoadTracker(num_kv_cache_groups=1, recent_ids_kept=total)
    req_ids = [f"r{i}" for i in range(total)]
    for i, req in enumerate(req_ids):
        tracker.track(req, [2 * i, 2 * i + 1], peers=PEERS)
    # Each request gets PEERS settling reports spread over different threads, plus noise
    # (duplicates and unknown ids) that must change nothing.
    should_fail = {req for i, req in enumerate(req_ids) if i % 3 == 0}
    work: list[list[tuple[str, int, bool]]] = [[] for _ in range(N_THREADS)]
    rng = random.Random(1234)
    for req in req_ids:
        failing_peer = rng.randrange(PEERS) if req in should_fail else -1
        for peer in range(PEERS):
            work[rng.randrange(N_THREADS)].append((req, peer, peer == failing_peer))
    for items in work:
        rng.shuffle(items)

    finished: Counter[str] = Counter()
    invalid: Counter[int] = Counter()
    stop = threading.Event()
    busy_drains: list[int] = []  # drains that delivered something while reporters ran
    start = threading.Barrier(N_THREADS + 1)

    def reporter(items: list[tuple[str, int, bool]]) -> None:
        start.wait(timeout=30)
        for req, peer, fail in items:
            if fail:
                tracker.failed(req, Stage.TRANSFER, "injected", peer=peer)
            else:
                tracker.succeeded(req, peer=peer)
            tracker.failed("unknown-" + req, Stage.TRANSFER, "noise")
            tracker.succeeded(req, peer=peer)  # duplicate from the same peer

    def drainer() -> None:
        start.wait(timeout=30)
        while not stop.is_set():
            report = tracker.drain()
            if report.finished_recving:
                busy_drains.append(len(report.finished_recving))
            finished.update(report.finished_recving)
            invalid.update(report.invalid_block_ids)
            # An engine drains once per step, not in a hot loop; a drainer that never
            # yields turns the tracker's lock into a GIL convoy (117 s for this test).
            stop.wait(0.0002)

    threads = [threading.Thread(target=reporter, args=(w,)) for w in work]
    drain_thread = threading.Thread(target=drainer)
    for th in [*threads, drain_thread]:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "a reporter thread did not finish in time"
    stop.set()
    drain_thread.join(timeout=30)
    assert not drain_thread.is_alive()
    report = tracker.drain()
    finished.update(report.finished_recving)
    invalid.update(report.invalid_block_ids)

    # The point is drains racing reports: most deliveries must come from them, not from
    # the final drain after every reporter stopped.
    assert len(busy_drains) > 10 and sum(busy_drains) > total // 2, busy_drains[:20]
    assert set(finished) == set(req_ids), "lost a request"
    assert max(finished.values()) == 1, "delivered a request twice"
    expected_invalid = {
        b for i, r in enumerate(req_ids) if r in should_fail for b in (2 * i, 2 * i + 1)
    }
    assert set(invalid) == expected_invalid and max(invalid.values()) == 1
    stats = tracker.stats()
    assert stats["loads_failed"] == len(should_fail)
    assert stats["unknown_reports"] == total * PEERS
    assert len(tracker) == 0
