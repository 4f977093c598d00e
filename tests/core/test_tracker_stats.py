"""The tracker's counters and log lines: one structured line per failed request, interval
stats that reset, totals that accumulate, and stable keys.
"""

from __future__ import annotations

import logging

import pytest

from kvfail import Stage
from tests.core.trackers import make_tracker


def test_one_structured_log_line_per_failed_request(caplog: pytest.LogCaptureFixture) -> None:
    t = make_tracker(name="mooncake")
    t.track("r1", [1], peers=2)
    with caplog.at_level(logging.ERROR, logger="kvfail"):
        t.failed("r1", Stage.HANDSHAKE, "zmq timeout", peer=0)
        t.failed("r1", Stage.TRANSFER, "again", peer=1)
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1
    fields = lines[0].kvfail  # type: ignore[attr-defined]
    assert fields["req_id"] == "r1" and fields["stage"] == "handshake"
    assert fields["connector"] == "mooncake" and fields["reason"] == "zmq timeout"
    assert "stage='handshake'" in lines[0].getMessage()


def test_interval_stats_reset_and_totals_accumulate() -> None:
    t = make_tracker()
    for i in range(3):
        t.track(f"r{i}", [i])
        t.failed(f"r{i}", Stage.PEER, "x")
    first = t.take_interval_stats()
    assert first["stage.peer"] == 3
    assert t.take_interval_stats().empty
    assert t.stats()["stage.peer"] == 3


def test_stats_keys_are_stable() -> None:
    keys = set(make_tracker().stats().as_dict())
    assert {"loads_failed", "unknown_reports", "stage.watchdog", "stage.transfer"} <= keys
