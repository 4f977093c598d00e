"""A harness gap on an older vLLM is an error of the tool, never a verdict.

Where the installed vLLM lacks a feature the harness needs, kvfail's code raises
:class:`kvfail.compat.MissingFeatureError`. However it surfaces (raised in a scenario or a
fixture, wrapped by another error, in a skip's reason, in an oracle's finding), the
scenario must fail the run and its record must be ``error``: never counted as a pass, a
skip, an xfail (a baseline entry does not absorb it), or a negative control's flag, even
when its message happens to name the clause the control is expected to break.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance import negative

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
TOY = "kvfail.harness.toy:ToyConnector"

_SCENARIOS = """
import pytest

from kvfail.compat import MissingFeatureError
from kvfail.conformance.suite import ConformanceViolation

GAP = MissingFeatureError("block_pool_binding", "C11 late write")


@pytest.fixture
def rig():
    raise GAP


def test_raised(scenario):
    raise GAP


def test_wrapped(scenario):
    try:
        raise GAP
    except MissingFeatureError as exc:
        raise RuntimeError("the engine could not be built") from exc


def test_as_skip(scenario):
    pytest.skip(f"requires async_load: {GAP}")


def test_in_a_finding(scenario):
    raise ConformanceViolation("test_in_a_finding", [f"C11 crash: {GAP}"])


def test_in_setup(scenario, rig):
    pass


def test_pass(scenario):
    pass
"""

GAPS = ("test_raised", "test_wrapped", "test_as_skip", "test_in_a_finding", "test_in_setup")


@pytest.fixture
def pytester(vllm_loaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, once vLLM is loaded (see ``selftest/conftest.py``)."""
    return pytester


def test_a_missing_feature_is_an_error_never_a_verdict(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_gaps=_SCENARIOS)
    baseline = pytester.path / "known.toml"
    baseline.write_text(
        f"[[known]]\nconnector = '{TOY}'\nscenario = 'test_in_a_finding'\npolicy = 'fail'\n"
        "layout = 'tp1'\nfindings = [{ clauses = ['C11'], check = 'crash' }]\n"
    )
    out = pytester.path / "report"
    result = pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        "--kvfail-report", str(out), "--kvfail-baseline", str(baseline),
    )  # fmt: skip
    # The run fails: one failed phase per gap, no skip, no xfail.
    reports = result.getreports("pytest_runtest_logreport")
    failed = {r.nodeid.split("::")[-1].split("[")[0] for r in reports if r.failed}
    assert failed == set(GAPS), failed
    assert not [r for r in reports if r.skipped or hasattr(r, "wasxfail")]
    for report in reports:
        if report.failed:
            assert "harness error, not a verdict" in str(report.longrepr), report.longrepr
    # The record says error, names the feature, and is no control's flag for the clause
    # its message mentions.
    records = {r["scenario"]: r for r in json.loads((out / "report.json").read_text())}
    assert {s: r["outcome"] for s, r in records.items()} == {
        **dict.fromkeys(GAPS, "error"),
        "test_pass": "passed",
    }
    for scenario in GAPS:
        record = records[scenario]
        assert "block_pool_binding" in record["reason"] and "C11" in record["reason"], record
        assert not negative.flags(record, negative.Flag(scenario, "C11")), record
    assert "5 error" in (out / "report.md").read_text()
