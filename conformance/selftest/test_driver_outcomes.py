"""What a driver that cannot run turns into: never a silent pass.

A driver whose start raises (a P that crashes, a broken rig) fails every scenario it was
asked for; it must not look like a skip. A driver whose transport is absent here is a
named skip, and a failure where the run requires every driver (the project's own CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

_SCENARIO = """
def test_one(scenario):
    scenario.engine()
"""


def _fake_resolve(monkeypatch: pytest.MonkeyPatch, *, start_error: bool, absent: bool) -> None:
    import kvfail.conformance.resolve as resolve_module
    from kvfail.conformance.toy_driver import ToyDriver

    class Broken(ToyDriver):
        def unavailable(self) -> str | None:
            return "its transport library is not installed here" if absent else None

        def start(self) -> None:
            if start_error:
                raise RuntimeError("P exited with status 1 while starting")

    monkeypatch.setattr(resolve_module, "resolve", lambda spec: Broken(spec))


def _outcome(pytester: pytest.Pytester, *args: str) -> tuple[str, str]:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_one=_SCENARIO)
    rec = pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        *args,
    )  # fmt: skip
    reports = rec.getreports("pytest_runtest_logreport")
    report = next(r for r in reports if r.when == "call" or not r.passed)
    return report.outcome, str(report.longrepr)


@pytest.fixture
def pytester(vllm_loaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, once vLLM is loaded (see ``selftest/conftest.py``)."""
    return pytester


def test_a_driver_whose_start_raises_fails_its_scenarios(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_resolve(monkeypatch, start_error=True, absent=False)
    outcome, text = _outcome(pytester)
    assert outcome == "failed", text
    assert "driver failed to start (RuntimeError: P exited with status 1" in text


def test_an_absent_transport_is_a_named_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_resolve(monkeypatch, start_error=False, absent=True)
    outcome, text = _outcome(pytester)
    assert outcome == "skipped", text
    assert "driver unavailable: its transport library is not installed here" in text


def test_an_absent_transport_fails_where_drivers_are_required(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_resolve(monkeypatch, start_error=False, absent=True)
    outcome, text = _outcome(pytester, "--kvfail-require-drivers")
    assert outcome == "failed", text
    assert "its transport library is not installed here (--kvfail-require-drivers)" in text


def test_the_old_fixture_name_is_the_same_scenario(pytester: pytest.Pytester) -> None:
    """``kvfail``, the fixture's old name, still runs a scenario written against it: it is
    the very context ``scenario`` gives, and the run records it as a scenario."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_old="def test_old(kvfail, scenario):\n    assert kvfail is scenario\n")
    out = pytester.path / "report"
    rec = pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        "--kvfail-report", str(out),
    )  # fmt: skip
    rec.assertoutcome(passed=1)
    records = json.loads((out / "report.json").read_text())
    assert [(r["scenario"], r["outcome"]) for r in records] == [("test_old", "passed")]
