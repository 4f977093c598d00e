"""Self-test of the suite: it must FLAG each negative control for the right reason, pass
the working connector, and never hide a skip.

Why: a conformance suite is only worth its negative controls. Each control in
``kvfail.conformance.negative`` breaks exactly one contract rule, in the toy connector
(fast; tests the oracles) and in the REAL ``KvfailMooncakeConnector`` (its worker broken
in one method; the real Mooncake driver, P process and TCP transport provoke the fault).
We run the real suite (``kvfail/conformance/scenarios/test_scenarios.py``; the toy session
also ``test_concurrency.py``, ``test_concurrency_soak.py`` and ``test_quarantine.py`` there)
against them in in-process sessions and read its ``report.json`` (each control flagged by its
:data:`~kvfail.conformance.negative.EXPECTED_FLAGS` scenario and its ``EXTRA_FLAGS`` ones).
In-process, so vLLM is imported once; everything the inner run needs is imported (and one
engine run) before it, because ``pytester`` (used for the skip test) unloads modules the
inner session imported.

The real-connector session runs only the scenarios the controls are built to break, plus
the two they must still pass, under ``recompute`` (where the scheduler would silently run
on whatever the blocks hold, so only the connector's report, or the byte check, can save
it); ``mooncake`` itself runs the full suite elsewhere (``--connector mooncake``).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import kvfail.conformance.negative as negative
from kvfail.conformance.capabilities import Capabilities, derive_from_class
from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS
from kvfail.harness import Engine, EngineSpec
from kvfail.harness.toy import ToyConnector
from tests.keyword_selection import each_control_only_its_own

SUITE = SCENARIOS / "test_scenarios.py"
#: The concurrency scenarios: a control built to lose concurrent failures is flagged there.
CONCURRENCY = SCENARIOS / "test_concurrency.py"
#: The soak: a control that loses concurrent failures is flagged there too (``EXTRA_FLAGS``).
SOAK = SCENARIOS / "test_concurrency_soak.py"
#: The quarantine scenario: a control that frees blocks a slow P still writes is flagged there.
QUARANTINE = SCENARIOS / "test_quarantine.py"
CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
CONTROLS = sorted(negative.EXPECTED_FLAGS)
REAL_CONTROLS = sorted(negative.EXPECTED_FLAGS_REAL)
#: What a real control must still pass (broken in ONE way), next to what it must fail.
REAL_SCENARIOS = (
    "test_local_request_untouched",
    "test_successful_load",
    "test_failed_load_one_group",
)


def _warm_up() -> None:
    """Run one toy load so every lazily imported vLLM module is loaded before pytester."""
    with Engine(EngineSpec(extra_config={"toy_mode": "complete"})) as engine:
        engine.add_request("warm", kv_transfer_params={"do_remote_prefill": True})
        assert engine.run_until_idle(max_steps=20, timeout_s=30.0).ok


#: What every toy control must still pass: broken in ONE way, the basics hold.
BASICS = ("test_successful_load", "test_local_request_untouched")


def _inner(out: Path, connectors: list[str], *extra: str) -> tuple[int, list[dict[str, Any]]]:
    """One inner session of the scenario modules at tp1 (the controls are each built to
    break one clause in the basic layout; the project's ini adds tp2-g2 to its run)."""
    args = [str(p) for p in (SUITE, CONCURRENCY, SOAK, QUARANTINE)]
    args += ["-p", "no:cacheprovider", "-q"]
    args += ["--layout", "tp1"]
    args += ["--kvfail-report", str(out), *extra]
    for spec in connectors:
        args += ["--connector", spec]
    ret = pytest.main(args)
    return int(ret), json.loads((out / "report.json").read_text())


def _selection() -> tuple[str, set[str]]:
    """A ``-k`` expression: each control with the scenarios built to flag it and the
    basics, and the toy with every scenario that flags some control (a flag is evidence
    only where the healthy toy passes); and that set of scenarios. Not every control over
    every flagging scenario: that only repeats work (the soak most of all). The toy's run
    over every scenario is the project's default run's."""
    wanted = set(BASICS)
    parts = []
    for control in CONTROLS:
        mine = {negative.EXPECTED_FLAGS[control].scenario, *BASICS}
        mine |= {f.scenario for f in negative.EXTRA_FLAGS.get(control, ())}
        wanted |= mine
        parts.append(f"({control} and ({' or '.join(sorted(mine))}))")
    parts.append(f"(toy and ({' or '.join(sorted(wanted))}))")
    return " or ".join(parts), wanted


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]], str]:
    """The toy and every control, in one inner session (see :func:`_selection`)."""
    _warm_up()
    # pytester is function-scoped; this module-wide inner session runs through pytest.main.
    out = tmp_path_factory.mktemp("kvfail-report")
    ret, records = _inner(
        out,
        ["toy", *(f"kvfail.conformance.negative:{c}" for c in CONTROLS)],
        "-k",
        _selection()[0],
    )
    return ret, records, (out / "report.md").read_text()


def _real_session(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    controls: list[str],
    targets: list[Path],
    *args: str,
) -> tuple[int, list[dict[str, Any]], str]:
    """One inner session of ``targets`` against ``mooncake`` (the reference) and the real
    ``controls``, with ``args``; skipped where Mooncake cannot run here."""
    from kvfail.peers.mooncake import mooncake_available

    why = mooncake_available()
    if why is not None or not controls:
        pytest.skip(f"real Mooncake controls cannot run here: {why or 'connector missing'}")
    _warm_up()
    out = tmp_path_factory.mktemp(name)
    argv = [*map(str, targets), "-p", "no:cacheprovider", "-q", "--kvfail-report", str(out)]
    argv += args
    for spec in ["mooncake", *(f"kvfail.conformance.negative:{c}" for c in controls)]:
        argv += ["--connector", spec]
    ret = pytest.main(argv)
    records = json.loads((out / "report.json").read_text())
    return int(ret), records, (out / "report.md").read_text()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]], str]:
    """One inner run against ``mooncake`` and every real-connector control (real P)."""
    args = ["--policy", "recompute", "--layout", "tp1", "-k", " or ".join(REAL_SCENARIOS)]
    return _real_session(tmp_path_factory, "kvfail-real-report", REAL_CONTROLS, [SUITE], *args)


def _records(run: tuple[int, list[dict[str, Any]], str], connector: str) -> list[dict[str, Any]]:
    return [r for r in run[1] if r["connector"] == connector]


def _why(recs: list[dict[str, Any]], scenario: str) -> list[tuple[str, str]]:
    """Each run of ``scenario``: its outcome and its reason, so a failure says what broke."""
    return [
        (r["outcome"], str(r.get("reason", ""))[:2000]) for r in recs if r["scenario"] == scenario
    ]


def test_report_has_required_fields(suite_run: Any) -> None:
    _ret, records, matrix = suite_run
    assert records
    for r in records:
        assert {
            "connector",
            "scenario",
            "policy",
            "outcome",
            "reason",
            "clauses",
            "duration_s",
        } <= r.keys()
        assert r["outcome"] in ("passed", "failed", "skipped", "xfailed", "error")
        assert r["clauses"], r
    assert "| scenario | clauses | fail | recompute |" in matrix


def test_toy_passes_every_scenario_that_flags_a_control(suite_run: Any) -> None:
    """A control's flag is evidence only where the healthy toy passes the same scenario,
    under each policy."""
    toy = _records(suite_run, "toy")
    wanted = {(s, p) for s in _selection()[1] for p in ("fail", "recompute")}
    passed = {(r["scenario"], r["policy"]) for r in toy if r["outcome"] == "passed"}
    bad = [(r["scenario"], r["policy"], r["outcome"], r["reason"]) for r in toy]
    assert passed == wanted and len(toy) == len(wanted), bad


@pytest.mark.parametrize("control", CONTROLS)
def test_negative_control_is_flagged_by_the_right_scenario(suite_run: Any, control: str) -> None:
    flag = negative.EXPECTED_FLAGS[control]
    recs = _records(suite_run, f"kvfail.conformance.negative:{control}")
    ran = [r for r in recs if r["scenario"] == flag.scenario and r["policy"] in flag.policies]
    assert {r["policy"] for r in ran} == flag.policies
    for r in ran:
        assert negative.flags(r, flag), (flag.clause, r["outcome"], r["reason"])
    # Broken in ONE way: the happy path and the request that never loads still pass.
    for ok in BASICS:
        outcomes = {r["outcome"] for r in recs if r["scenario"] == ok}
        assert outcomes == {"passed"}, (ok, _why(recs, ok))


@pytest.mark.parametrize(
    ("control", "flag"),
    [(c, f) for c, flags in sorted(negative.EXTRA_FLAGS.items()) for f in flags],
    ids=lambda v: v if isinstance(v, str) else v.scenario,
)
def test_negative_control_is_flagged_by_further_scenarios(
    suite_run: Any, control: str, flag: negative.Flag
) -> None:
    """A control is flagged for its reason by every further scenario named for it (the
    soak, for a control that loses concurrent failures), not only by the one built for it."""
    recs = _records(suite_run, f"kvfail.conformance.negative:{control}")
    ran = [r for r in recs if r["scenario"] == flag.scenario and r["policy"] in flag.policies]
    assert {r["policy"] for r in ran} == flag.policies
    for r in ran:
        assert negative.flags(r, flag), (flag.clause, r["outcome"], r["reason"])


def _reference_passes_all(
    run: tuple[int, list[dict[str, Any]], str], scenarios: Collection[str]
) -> None:
    """``mooncake`` ran exactly ``scenarios`` and passed each: what flags a control there
    is the control's own breakage, not the scenario's or the rig's."""
    recs = _records(run, "mooncake")
    assert {r["scenario"] for r in recs} == set(scenarios)
    assert [
        (r["scenario"], r["outcome"], r["reason"]) for r in recs if r["outcome"] != "passed"
    ] == []


def test_real_mooncake_passes_what_the_controls_break(real_run: Any) -> None:
    _reference_passes_all(real_run, REAL_SCENARIOS)


@pytest.mark.parametrize("control", REAL_CONTROLS)
def test_real_negative_control_is_flagged_by_the_right_scenario(
    real_run: Any, control: str
) -> None:
    """The control resolves to the real Mooncake driver (not the generic one), fails the
    scenario it was built to break for the clause it breaks, and passes the others."""
    flag = negative.EXPECTED_FLAGS_REAL[control]
    recs = _records(real_run, f"kvfail.conformance.negative:{control}")
    assert {r["scenario"] for r in recs} == set(REAL_SCENARIOS), recs
    ran = [r for r in recs if r["scenario"] == flag.scenario]
    assert len(ran) == 1 and negative.flags(ran[0], flag), (flag.clause, ran)
    for ok in set(REAL_SCENARIOS) - {flag.scenario}:
        outcomes = {r["outcome"] for r in recs if r["scenario"] == ok}
        assert outcomes == {"passed"}, (ok, _why(recs, ok))


#: Real controls of the deadline scenarios, and those scenarios (each control's flags).
DEADLINE_CONTROLS = sorted(negative.EXPECTED_FLAGS_REAL_DEADLINE)
DEADLINE_SCENARIOS = sorted(
    {f.scenario for flags in negative.EXPECTED_FLAGS_REAL_DEADLINE.values() for f in flags}
)
#: ``mooncake`` over every deadline scenario, each control over its own flags' only.
_DEADLINE_K = each_control_only_its_own(
    DEADLINE_SCENARIOS,
    {c: [f.scenario for f in flags] for c, flags in negative.EXPECTED_FLAGS_REAL_DEADLINE.items()},
)


@pytest.fixture(scope="module")
def real_deadline_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[int, list[dict[str, Any]], str]:
    """``mooncake`` (the reference) and the real deadline controls, through the scenarios
    only a deadline can end: a P that never answers, and a slow P that answers after the
    deadline (``test_quarantine.py``). One policy: the verdict these controls break is
    the connector's bound on a load, which no policy changes."""
    args = ["--policy", "fail", "--layout", "tp1", "-k", _DEADLINE_K]
    return _real_session(
        tmp_path_factory,
        "kvfail-real-deadline-report",
        DEADLINE_CONTROLS,
        [SUITE, QUARANTINE],
        *args,
    )


def test_real_mooncake_passes_the_deadline_scenarios(real_deadline_run: Any) -> None:
    _reference_passes_all(real_deadline_run, DEADLINE_SCENARIOS)


@pytest.mark.parametrize("control", DEADLINE_CONTROLS)
def test_real_deadline_control_is_flagged_by_every_scenario_named(
    real_deadline_run: Any, control: str
) -> None:
    """Flagged for the same reason by a P that never answers and by a slow one that does:
    the verdict does not turn on whether P beat the suite's wait."""
    recs = _records(real_deadline_run, f"kvfail.conformance.negative:{control}")
    flags = negative.EXPECTED_FLAGS_REAL_DEADLINE[control]
    assert sorted(r["scenario"] for r in recs) == sorted(f.scenario for f in flags), recs
    for flag in flags:
        ran = [r for r in recs if r["scenario"] == flag.scenario]
        assert len(ran) == 1 and negative.flags(ran[0], flag), (flag, _why(recs, flag.scenario))


HETERO_CONTROLS = sorted(negative.EXPECTED_FLAGS_REAL_HETERO)


@pytest.fixture(scope="module")
def real_hetero_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[int, list[dict[str, Any]], str]:
    """``mooncake`` and the real controls at P TP 2 with D TP 1, through the scenario
    where one P rank is lost while D's one rank reads from both, under ``recompute``
    (where a half-loaded request would run on the missing heads)."""
    scenarios = sorted({f.scenario for f in negative.EXPECTED_FLAGS_REAL_HETERO.values()})
    args = ["--policy", "recompute", "--layout", "p2d1", "-k", " or ".join(scenarios)]
    return _real_session(
        tmp_path_factory, "kvfail-real-hetero-report", HETERO_CONTROLS, [SUITE], *args
    )


@pytest.mark.parametrize("control", HETERO_CONTROLS)
def test_real_control_is_flagged_in_the_heterogeneous_layout(
    real_hetero_run: Any, control: str
) -> None:
    """Flagged where the real connector itself passes the same scenario."""
    flag = negative.EXPECTED_FLAGS_REAL_HETERO[control]
    ref = [r for r in _records(real_hetero_run, "mooncake") if r["scenario"] == flag.scenario]
    assert [r["outcome"] for r in ref] == ["passed"], _why(ref, flag.scenario)
    recs = _records(real_hetero_run, f"kvfail.conformance.negative:{control}")
    ran = [r for r in recs if r["scenario"] == flag.scenario]
    assert len(ran) == 1 and negative.flags(ran[0], flag), (flag, _why(recs, flag.scenario))


def test_real_controls_resolve_to_the_mooncake_driver() -> None:
    from kvfail.conformance.mooncake_driver import MooncakeDriver
    from kvfail.conformance.resolve import resolve

    if not REAL_CONTROLS:
        pytest.skip("connectors.mooncake is not importable here")
    for control in [*REAL_CONTROLS, *DEADLINE_CONTROLS]:
        driver = resolve(f"kvfail.conformance.negative:{control}")
        assert isinstance(driver, MooncakeDriver), (control, type(driver).__name__)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--connector", "garbage"], "--connector garbage: unknown connector; accepted: "),
        (
            ["--connector", "no_such_module:NoSuchConnector"],
            "--connector no_such_module:NoSuchConnector: no_such_module:NoSuchConnector cannot "
            "be imported (ModuleNotFoundError",
        ),
        (["--connector", "toy", "--layout", "tp9"], "--layout: unknown layout 'tp9'"),
        (["--connector", "toy", "--policy", "sometimes"], "invalid choice: 'sometimes'"),
    ],
)
def test_bad_arguments_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], says: str
) -> None:
    """A typo stops the run with one line saying what is wrong and what is accepted: never
    a run of skips (which exits 0), never an INTERNALERROR traceback."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_which=_ONE_SCENARIO)
    result = pytester.runpytest_inprocess(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    out = result.stdout.str() + result.stderr.str()
    assert says in out, out
    assert "Traceback" not in out and "INTERNALERROR" not in out, out


def test_capabilities_are_derived_from_the_class() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class Bare(KVConnectorBase_V1):  # never instantiated: only its MRO is read
        pass

    toy = derive_from_class(ToyConnector)
    assert toy["hma"][0] and toy["block_level_failures"][0] and toy["request_level_failures"][0]
    silent = derive_from_class(negative.NoFailureChannel)  # set back to the base's own
    assert not (silent["block_level_failures"][0] or silent["request_level_failures"][0])
    bare = derive_from_class(Bare)
    assert not (bare["hma"][0] or bare["block_level_failures"][0])
    assert not bare["request_level_failures"][0]
    caps = Capabilities.build(Bare, driver="unit", declared={"async_load": (True, "declared")})
    assert caps.async_load and not caps.hma
    assert caps.missing("hma") == "requires hma: Bare does not implement SupportsHMA"
    with pytest.raises(ValueError, match="introspected"):
        Capabilities.build(Bare, driver="liar", declared={"hma": (True, "trust me")})


def test_unexplained_skip_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        test_skips="""
import pytest

def test_hidden(scenario):
    pytest.skip("flaky network")

def test_dressed_up(scenario):
    pytest.skip("requires sync_load: a free-text reason is not the suite's")

def test_named(scenario):
    scenario.require("sync_load")
"""
    )
    result = pytester.runpytest_inprocess(
        "--connector", "toy", "--policy", "fail", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(failed=2, skipped=1)
    result.stdout.fnmatch_lines(["*skip inside a scenario*flaky network*"])
    result.stdout.fnmatch_lines(["*skip inside a scenario*a free-text reason is not the suite's*"])
    result.stdout.fnmatch_lines(["*requires sync_load: ToyConnector only advertises asynchronous*"])


_ONE_SCENARIO = """
def test_which(scenario):
    scenario.note("connector", scenario.driver.name)
"""


def test_ini_kvfail_connectors_is_the_default_list(pytester: pytest.Pytester) -> None:
    """``kvfail_connectors`` in the ini file gives the connectors when no ``--connector``
    is given (the project's default run); an explicit ``--connector`` replaces the list."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini(
        "[pytest]\nkvfail_connectors = toy kvfail.conformance.negative:SwallowsFailure\n"
    )
    pytester.makepyfile(test_which=_ONE_SCENARIO)
    default = pytester.runpytest_inprocess("--policy", "fail", "-p", "no:cacheprovider", "-v")
    default.assert_outcomes(passed=2)
    default.stdout.fnmatch_lines(["*test_which?toy-fail?*", "*test_which?*SwallowsFailure-fail?*"])
    explicit = pytester.runpytest_inprocess(
        "--connector", "toy", "--policy", "fail", "-p", "no:cacheprovider", "-v"
    )
    explicit.assert_outcomes(passed=1)
    assert "SwallowsFailure" not in explicit.stdout.str()
