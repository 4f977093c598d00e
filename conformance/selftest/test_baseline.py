"""The baseline: known violations a user passes, each pinned to its findings' fingerprints.

What must hold (see ``kvfail.conformance.baseline``): without a baseline every violation
fails; an entry absorbs only oracle findings whose fingerprint (clauses, check, stage) it
lists, never an error and never another check's finding of the same clause; an entry whose
scenario passes fails the run as fixed, one whose scenario skips as stale; an old
clause-only entry is refused naming the file and entry; and an entry names one exact
class, so a subclass is judged on its own behaviour, the same as its parent without a
baseline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfail.conformance.baseline import (
    Baseline,
    BaselineError,
    Entry,
    Fingerprint,
    clauses_of,
    fingerprint,
    render_baseline,
)
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
SUITE = SCENARIOS / "test_scenarios.py"
TOY = "kvfail.harness.toy:ToyConnector"


def test_clauses_are_read_from_the_head_of_each_finding() -> None:
    assert clauses_of("C2/C10 liveness: r still waiting") == {"C2", "C10"}
    assert clauses_of("[abort-then-success] C9 leak: 3 free blocks") == {"C9"}
    assert clauses_of("warm-up load (3 tries): C1 unreported: x") == {"C1"}
    assert clauses_of("liveness: 1 unfinished request(s)") == frozenset()


def test_a_fingerprint_is_clauses_check_and_stage_without_the_runs_particulars() -> None:
    assert fingerprint("C2/C10 liveness: r-1 still waiting after 9 steps") == Fingerprint(
        ("C2", "C10"), "liveness", "scenario"
    )
    assert fingerprint("[abort-then-success] C9 leak: 3 free blocks") == Fingerprint(
        ("C9",), "leak", "abort-then-success"
    )
    assert fingerprint("warm-up load (3 tries): C1 unreported: x") == Fingerprint(
        ("C1",), "unreported", "warm-up load"
    )
    assert fingerprint("C12 (#55297): r re-entered") == Fingerprint(("C12",), "", "scenario")
    # Same clause, other check: another fingerprint.
    assert fingerprint("C1 wrong KV: r ran on bytes") != fingerprint("C1 unreported: r")
    assert fingerprint("liveness: 1 unfinished request(s)") is None


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "baseline.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("known = 3", "array of tables"),
        ("[[known]]\nconnector = 'a:B'\nscenario = 's'\npolicy = 'fail'\n", "missing layout"),
        (
            "[[known]]\nconnector = 'a:B'\nscenario = 's'\npolicy = 'fail'\nlayout = 'tp1'\n"
            "findings = [{ clauses = ['ten'], check = 'leak' }]\n",
            "finding 1: expected",
        ),
        (
            "[[known]]\nconnector = 'B'\nscenario = 's'\npolicy = 'fail'\nlayout = 'tp1'\n"
            "findings = [{ clauses = ['C1'], check = 'unreported' }]\n",
            "module:qualname",
        ),
        (
            # The old form: a clause set absorbed any finding of those clauses.
            "[[known]]\nconnector = 'a:B'\nscenario = 's'\npolicy = 'fail'\nlayout = 'tp1'\n"
            "clauses = ['C1', 'C10']\n",
            r"entry 1 \(s \[fail, tp1\]\): a clause-only entry .* --kvfail-write-baseline",
        ),
        ("[[known]\n", "not valid TOML"),
    ],
)
def test_a_malformed_baseline_is_refused(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(BaselineError, match=says):
        Baseline.load(_write(tmp_path, text))


def test_duplicate_entries_are_refused_and_rendering_round_trips(tmp_path: Path) -> None:
    prints = frozenset(
        {Fingerprint(("C2", "C10"), "liveness", "scenario"), Fingerprint(("C9",), "leak", "x")}
    )
    entry = Entry(TOY, "test_x", "fail", "tp1", prints, 'a "quoted" reason')
    text = render_baseline([entry])
    loaded = Baseline.load(_write(tmp_path, text))
    got = loaded.lookup(TOY, "test_x", "fail", "tp1")
    assert got is not None and got.findings == prints and got.reason == entry.reason
    assert got.clauses == {"C2", "C9", "C10"}
    assert loaded.lookup(TOY, "test_x", "recompute", "tp1") is None
    with pytest.raises(BaselineError, match="duplicates"):
        Baseline.load(_write(tmp_path, text + text.split("\n", 2)[2]))


_SCENARIOS = """
from kvfail.conformance.suite import ConformanceViolation


def test_pass(scenario):
    pass


def test_c1(scenario):
    # The peer's output is evidence, never a finding: its C7 must not count.
    evidence = ["[P pid 1] C7: ERROR a line the peer printed"]
    raise ConformanceViolation("test_c1", ["C1 unreported: r's load failed"], evidence)


def test_c1_and_c7(scenario):
    raise ConformanceViolation("test_c1_and_c7", ["C1 unreported: r", "C7: phantom report"])


def test_c1_wrong_kv(scenario):
    raise ConformanceViolation("test_c1_wrong_kv", ["C1 wrong KV: r ran on bytes P never sent"])


def test_skips(scenario):
    scenario.require_layout("tp2")


def test_error(scenario):
    raise RuntimeError("the harness broke")
"""


def _entry(scenario: str, *checks: str) -> str:
    """An entry for ``scenario`` listing findings of the scenario stage, each ``"C1 check"``."""
    prints = []
    for c in checks:
        clause, _, check = c.partition(" ")
        prints.append(f"{{ clauses = ['{clause}'], check = '{check}', stage = 'scenario' }}")
    return (
        f"[[known]]\nconnector = '{TOY}'\nscenario = '{scenario}'\npolicy = 'fail'\n"
        f"layout = 'tp1'\nfindings = [{', '.join(prints)}]\n"
    )


def _outcomes(result: pytest.HookRecorder) -> dict[str, str]:
    out = {}
    for report in result.getreports("pytest_runtest_logreport"):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            name = report.nodeid.split("::")[-1].split("[")[0]
            out[name] = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    return out


@pytest.fixture
def pytester(vllm_loaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, once vLLM is loaded (see ``selftest/conftest.py``)."""
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> pytest.HookRecorder:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_scenarios_here=_SCENARIOS)
    return pytester.inline_run(
        "--connector", "toy", "--policy", "fail", "--layout", "tp1", "-p", "no:cacheprovider",
        *args,
    )  # fmt: skip


def test_without_a_baseline_every_violation_fails(pytester: pytest.Pytester) -> None:
    result = _run(pytester)
    assert _outcomes(result) == {
        "test_pass": "passed",
        "test_c1": "failed",
        "test_c1_and_c7": "failed",
        "test_c1_wrong_kv": "failed",
        "test_error": "failed",
        "test_skips": "skipped",
    }
    reports = result.getreports("pytest_runtest_logreport")
    (c1,) = [str(r.longrepr) for r in reports if r.failed and "test_c1[" in r.nodeid]
    # A failing scenario shows what its peers printed, under its findings.
    assert "what the peers printed during the scenario" in c1
    assert "[P pid 1] C7: ERROR a line the peer printed" in c1


def test_an_entry_absorbs_only_its_fingerprints_never_an_error(
    pytester: pytest.Pytester,
) -> None:
    baseline = pytester.path / "known.toml"
    baseline.write_text(
        _entry("test_c1", "C1 unreported")
        + _entry("test_c1_and_c7", "C1 unreported")
        + _entry("test_c1_wrong_kv", "C1 unreported")
        + _entry("test_error", "C1 unreported")
    )
    result = _run(pytester, "--kvfail-baseline", str(baseline), "-k", "not test_skips")
    assert _outcomes(result) == {
        "test_pass": "passed",
        "test_c1": "xfailed",  # its own fingerprint (the peer's C7 line is evidence)
        "test_c1_and_c7": "failed",  # C7 is another clause's failure
        "test_c1_wrong_kv": "failed",  # C1 too, but another check: wrong KV, not unreported
        "test_error": "failed",  # an error is never a known violation
    }
    reports = result.getreports("pytest_runtest_logreport")
    failed = {r.nodeid: str(r.longrepr) for r in reports if r.failed}
    (c7,) = [v for k, v in failed.items() if "test_c1_and_c7" in k]
    assert "does not cover: C7: phantom report" in c7
    (wrong,) = [v for k, v in failed.items() if "test_c1_wrong_kv" in k]
    assert "does not cover: C1 wrong KV" in wrong


def _lone_entry_fails(
    pytester: pytest.Pytester, scenario: str
) -> tuple[Path, pytest.HookRecorder, str]:
    """Run only ``scenario`` with a baseline naming it alone: the scenario must fail (an
    entry that no longer matches fails its run); returns the baseline, the run and the
    one failure's text."""
    baseline = pytester.path / "known.toml"
    baseline.write_text(_entry(scenario, "C1 unreported"))
    result = _run(pytester, "--kvfail-baseline", str(baseline), "-k", scenario)
    assert _outcomes(result) == {scenario: "failed"}
    (report,) = [r for r in result.getreports("pytest_runtest_logreport") if r.failed]
    return baseline, result, str(report.longrepr)


def test_an_entry_whose_scenario_skips_fails_the_run_as_stale(pytester: pytest.Pytester) -> None:
    _baseline, result, failure = _lone_entry_fails(pytester, "test_skips")
    assert "baseline entry stale" in failure
    assert "requires tp2 layout" in failure
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_an_entry_that_passes_fails_the_run_as_fixed(pytester: pytest.Pytester) -> None:
    baseline, _result, failure = _lone_entry_fails(pytester, "test_pass")
    assert "baseline entry fixed" in failure
    assert str(baseline) in failure


def test_a_missing_baseline_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--kvfail-baseline", "no-such-file.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


@pytest.fixture(scope="module")
def subclass_module(tmp_path_factory: pytest.TempPathFactory, vllm_loaded: None) -> Any:
    """A module holding an unmodified subclass of a negative control, importable by the
    inner sessions (``module:Class``)."""
    folder = tmp_path_factory.mktemp("subclass")
    (folder / "kvfail_selftest_subclass.py").write_text(
        "from kvfail.conformance.negative import SwallowsFailure\n\n\n"
        "class Unmodified(SwallowsFailure):\n    pass\n"
    )
    sys.path.insert(0, str(folder))
    yield "kvfail_selftest_subclass:Unmodified"
    sys.path.remove(str(folder))


def _suite(tmp: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    out = tmp / "report"
    argv = [str(SUITE), "-p", "no:cacheprovider", "-q", "--layout", "tp1", "--policy", "fail"]
    argv += ["-k", "test_failed_load_one_group or test_successful_load", "--kvfail-report"]
    ret = pytest.main([*argv, str(out), *args])
    return int(ret), json.loads((out / "report.json").read_text())


def test_a_written_baseline_matches_by_fingerprint_and_a_subclass_keeps_its_own_verdict(
    tmp_path: Path, subclass_module: str
) -> None:
    """The real suite against a broken control and its unmodified subclass: the same
    verdicts without a baseline; a baseline written from the control's run absorbs the
    control's failure (fingerprint for fingerprint) and not the subclass's."""
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
    control = "kvfail.conformance.negative:SwallowsFailure"
    written = tmp_path / "written.toml"
    ret, records = _suite(
        tmp_path / "a",
        *("--connector", control, "--connector", subclass_module),
        *("--kvfail-write-baseline", str(written)),
    )
    assert ret == pytest.ExitCode.TESTS_FAILED

    def verdicts(spec: str, recs: list[dict[str, Any]]) -> dict[str, str]:
        return {r["scenario"]: r["outcome"] for r in recs if r["connector"] == spec}

    assert verdicts(control, records) == verdicts(subclass_module, records)
    assert verdicts(control, records)["test_failed_load_one_group"] == "failed"
    baseline = Baseline.load(written)
    # An entry names the class where it is defined, however the run named it: the same
    # class gets the same entry from `negative:X` and `negative.toy:X`.
    from kvfail.conformance.negative import SwallowsFailure

    defined = f"{SwallowsFailure.__module__}:{SwallowsFailure.__qualname__}"
    (entry,) = [e for e in baseline.entries.values() if e.connector == defined]
    assert entry.scenario == "test_failed_load_one_group" and {"C2", "C10"} <= entry.clauses
    control_only = tmp_path / "control-only.toml"
    control_only.write_text(render_baseline([entry]))

    ret, records = _suite(tmp_path / "b", "--connector", control, "--kvfail-baseline", str(written))
    assert ret == pytest.ExitCode.OK
    assert verdicts(control, records)["test_failed_load_one_group"] == "xfailed"
    ret, records = _suite(
        tmp_path / "c", "--connector", subclass_module, "--kvfail-baseline", str(control_only)
    )
    assert ret == pytest.ExitCode.TESTS_FAILED
    assert verdicts(subclass_module, records)["test_failed_load_one_group"] == "failed"
