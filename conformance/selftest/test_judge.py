"""Only the suite decides that a scenario did not judge the connector, and a run that
judged a clause nowhere fails.

A driver is the connector author's code and runs inside every scenario: a
``pytest.skip("requires ...")`` or ``pytest.xfail(...)`` it raises when a load misbehaves
must fail the scenario, not turn it green. A skip the suite raises names a capability the
connector really lacks. An engine that cannot be built is an error. A connector no driver
can feed (the generic driver: no remote prefill, no failure channel) gets no verdict on
the clauses the skipped scenarios cite, and the run exits non-zero naming them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

_SCENARIO = """
import pytest


@pytest.mark.clauses("C1")
def test_load(scenario):
    engine = scenario.engine()
    scenario.add_loading(engine, scenario.rid("x"))


def test_layout(scenario):
    scenario.require_layout("tp2")


def test_forged(scenario):
    from kvfail.conformance.suite import SuiteSkip

    raise SuiteSkip("requires remote_prefill: forged", ("remote_prefill",))
"""


def _driver(monkeypatch: pytest.MonkeyPatch, behaviour: str) -> None:
    """Resolve every connector to the toy driver, with one misbehaviour of its own."""
    import kvfail.conformance.resolve as resolve_module
    from kvfail.conformance.toy_driver import ToyDriver

    class Misbehaving(ToyDriver):
        def add_remote_request(self, *args: Any, **kwargs: Any) -> Any:
            if behaviour == "skip":
                pytest.skip("requires remote_prefill: the load misbehaved")
            if behaviour == "xfail":
                pytest.xfail("known flaky load")
            return super().add_remote_request(*args, **kwargs)

        def build_engine(self, *args: Any, **kwargs: Any) -> Any:
            if behaviour == "import":
                raise ImportError("No module named 'absent_transport'")
            return super().build_engine(*args, **kwargs)

    monkeypatch.setattr(resolve_module, "resolve", lambda spec: Misbehaving(spec))


@pytest.fixture
def pytester(vllm_loaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, once vLLM is loaded (see ``selftest/conftest.py``)."""
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.HookRecorder, dict[str, Any]]:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_judged=_SCENARIO)
    rec = pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        *args,
    )  # fmt: skip
    out = {}
    for report in rec.getreports("pytest_runtest_logreport"):
        if report.when == "call" or not report.passed:
            name = report.nodeid.split("::")[-1].split("[")[0]
            out.setdefault(name, (report.outcome, str(report.longrepr)))
    return rec, out


@pytest.mark.parametrize("behaviour", ["skip", "xfail"])
def test_a_driver_that_skips_or_xfails_inside_a_scenario_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, behaviour: str
) -> None:
    _driver(monkeypatch, behaviour)
    rec, out = _run(pytester, "-k", "test_load")
    outcome, text = out["test_load"]
    assert outcome == "failed", text
    assert "not the suite's to decide" in text
    assert rec.ret == pytest.ExitCode.TESTS_FAILED


def test_the_suites_own_skip_is_accepted_and_a_forged_one_is_not(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _driver(monkeypatch, "none")
    _rec, out = _run(pytester, "-k", "test_layout or test_forged")
    assert out["test_layout"][0] == "skipped", out["test_layout"]
    assert "requires tp2 layout" in out["test_layout"][1]
    # The toy has remote_prefill: a skip claiming it lacks it is not the suite's.
    assert out["test_forged"][0] == "failed", out["test_forged"]


def test_an_engine_that_cannot_be_built_is_an_error_not_a_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _driver(monkeypatch, "import")
    rec, out = _run(pytester, "-k", "test_load")
    outcome, text = out["test_load"]
    assert outcome == "failed", text
    assert "cannot build the engine" in text and "absent_transport" in text
    assert rec.ret == pytest.ExitCode.TESTS_FAILED


_NO_CHANNEL = '''
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


class NoChannelConnector(KVConnectorBase_V1):
    """No kvfail driver claims it, and it has no failure channel."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
'''


def test_a_connector_no_driver_can_feed_exits_non_zero_naming_the_clauses(
    tmp_path: Path, vllm_loaded: None
) -> None:
    """The generic driver declares no remote prefill: every load scenario skips, the one
    that needs none passes, and before the coverage gate the run exited 0."""
    (tmp_path / "kvfail_selftest_nochannel.py").write_text(_NO_CHANNEL)
    sys.path.insert(0, str(tmp_path))
    try:
        out = tmp_path / "report"
        ret = pytest.main(
            [
                str(SCENARIOS / "test_scenarios.py"),
                *("-p", "no:cacheprovider", "-q", "--layout", "tp1", "--policy", "fail"),
                *("-k", "test_local_request_untouched or test_successful_load"),
                *("--connector", "kvfail_selftest_nochannel:NoChannelConnector"),
                *("--kvfail-report", str(out)),
            ]
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kvfail_selftest_nochannel", None)
    records = json.loads((out / "report.json").read_text())
    outcomes = {r["scenario"]: r["outcome"] for r in records}
    assert outcomes == {"test_local_request_untouched": "passed", "test_successful_load": "skipped"}
    assert ret == pytest.ExitCode.TESTS_FAILED
    unverified = json.loads((out / "coverage.json").read_text())["unverified"]
    spec = "kvfail_selftest_nochannel:NoChannelConnector"
    assert any(line.startswith(f"C1 unverified for {spec}") for line in unverified)
    assert all("requires remote_prefill" in line for line in unverified), unverified
    assert "C1 unverified" in (out / "report.md").read_text()


_BROKEN_PARSER = """
import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # The parser's state as another thread's race left it, while the report is made.
    import ast

    def broken(*args, **kwargs):
        raise SystemError("AST constructor recursion depth mismatch (before=90, after=65)")

    parse, ast.parse = ast.parse, broken
    try:
        return (yield)
    finally:
        ast.parse = parse
"""

_CRASH = """
def test_crash(scenario):
    raise RuntimeError("the connector crashed")
"""


def test_a_scenarios_failure_is_rendered_without_parsing_source(
    pytester: pytest.Pytester,
) -> None:
    """pytest renders a failure by parsing each frame's source with :mod:`ast`; a run that
    met a broken parser there ended in an INTERNALERROR and lost its report. A scenario's
    failure is rendered by the suite, which parses nothing: the run ends as a failure."""
    pytester.makeconftest(CONFTEST.read_text() + _BROKEN_PARSER)
    pytester.makepyfile(test_crashing=_CRASH)
    rec = pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
    )  # fmt: skip
    (report,) = [r for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert "RuntimeError: the connector crashed" in str(report.longrepr)
    assert 'in test_crash\n    raise RuntimeError("the connector crashed")' in str(report.longrepr)
    assert rec.ret == pytest.ExitCode.TESTS_FAILED
