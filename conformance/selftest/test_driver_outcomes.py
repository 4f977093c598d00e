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


def _inline_run(pytester: pytest.Pytester, *args: str) -> pytest.HookRecorder:
    """The suite's conftest, run on the toy driver for one policy and layout."""
    pytester.makeconftest(CONFTEST.read_text())
    return pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        *args,
    )  # fmt: skip


def _outcome(pytester: pytest.Pytester, *args: str) -> tuple[str, str]:
    pytester.makepyfile(test_one=_SCENARIO)
    reports = _inline_run(pytester, *args).getreports("pytest_runtest_logreport")
    report = next(r for r in reports if r.when == "call" or not r.passed)
    return report.outcome, str(report.longrepr)


@pytest.fixture
def pytester(vllm_loaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, once vLLM is loaded (see ``selftest/conftest.py``)."""
    return pytester


@pytest.mark.parametrize(
    ("start_error", "absent", "args", "expected", "says"),
    [
        pytest.param(
            True, False, (), "failed",
            "driver failed to start (RuntimeError: P exited with status 1",
            id="start-raises-fails",
        ),
        pytest.param(
            False, True, (), "skipped",
            "driver unavailable: its transport library is not installed here",
            id="absent-transport-is-a-named-skip",
        ),
        pytest.param(
            False, True, ("--kvfail-require-drivers",), "failed",
            "its transport library is not installed here (--kvfail-require-drivers)",
            id="absent-transport-fails-where-drivers-are-required",
        ),
    ],
)  # fmt: skip
def test_a_driver_that_cannot_run(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    start_error: bool,
    absent: bool,
    args: tuple[str, ...],
    expected: str,
    says: str,
) -> None:
    """A driver whose start raises fails its scenarios; one whose transport is absent is
    a named skip, and a failure where every driver is required."""
    _fake_resolve(monkeypatch, start_error=start_error, absent=absent)
    outcome, text = _outcome(pytester, *args)
    assert outcome == expected, text
    assert says in text


def test_the_old_fixture_name_is_the_same_scenario(pytester: pytest.Pytester) -> None:
    """``kvfail``, the fixture's old name, still runs a scenario written against it: it is
    the very context ``scenario`` gives, and the run records it as a scenario."""
    pytester.makepyfile(test_old="def test_old(kvfail, scenario):\n    assert kvfail is scenario\n")
    out = pytester.path / "report"
    rec = _inline_run(pytester, "--kvfail-report", str(out))
    rec.assertoutcome(passed=1)
    records = json.loads((out / "report.json").read_text())
    assert [(r["scenario"], r["outcome"]) for r in records] == [("test_old", "passed")]
