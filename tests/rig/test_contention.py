"""The contention meter: what the suite stretches its verdict-deciding waits by.

No wall-clock claim is made about the machine: the probe's direction is checked with a
thread that holds the GIL (it can only slow the probe further on a loaded machine), and
the scheduler-statistics window with statistics written by the test itself."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvfail.conformance import timebase
from kvfail.rig import contention
from kvfail.rig.contention import MAX_FACTOR, ContentionMeter, probe_factor


def test_the_factor_is_bounded_on_any_machine() -> None:
    meter = ContentionMeter()
    for _ in range(3):
        assert 1.0 <= meter.measure() <= MAX_FACTOR


def test_a_thread_holding_the_gil_slows_the_probe() -> None:
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=hog, daemon=True)
    thread.start()
    try:
        # Two threads wanting one interpreter: the probe gets about half of its time.
        assert probe_factor(cpu_s=0.05) > 1.2
    finally:
        stop.set()
        thread.join(timeout=5)


def _schedstat(path: Path, ran_ns: int, waited_ns: int) -> None:
    path.write_text(f"{ran_ns} {waited_ns} 10\n")


def test_the_window_since_the_last_measure_counts_time_spent_waiting_for_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stat = tmp_path / "schedstat"
    monkeypatch.setattr(contention, "SCHEDSTAT", stat)
    monkeypatch.setattr(contention, "probe_factor", lambda cpu_s=0.0: 1.0)
    _schedstat(stat, 1_000_000_000, 0)
    meter = ContentionMeter(cap=10.0)
    # Ran 100 ms and waited 150 ms for a CPU: 2.5 times slower than its own CPU time.
    _schedstat(stat, 1_100_000_000, 150_000_000)
    assert meter.measure() == pytest.approx(2.5)
    # A window too short to say anything leaves the probe's answer.
    _schedstat(stat, 1_101_000_000, 900_000_000)
    assert meter.measure() == pytest.approx(1.0)
    # Never past the cap, however loaded the machine.
    _schedstat(stat, 2_101_000_000, 90_000_000_000)
    assert meter.measure() == pytest.approx(10.0)


def test_without_scheduler_statistics_the_probe_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(contention, "SCHEDSTAT", tmp_path / "absent")
    monkeypatch.setattr(contention, "probe_factor", lambda cpu_s=0.0: 1.7)
    assert ContentionMeter().measure() == pytest.approx(1.7)


def test_the_suite_scales_its_waits_by_the_last_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    class Meter:
        def measure(self) -> float:
            return 2.0

    monkeypatch.setattr(timebase, "_meter", Meter())
    monkeypatch.setattr(timebase, "_scale", 1.0)
    assert timebase.scaled(6.0) == 6.0
    assert timebase.measure() == 2.0
    assert timebase.current() == 2.0
    assert timebase.scaled(6.0) == 12.0
