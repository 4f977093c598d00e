"""What a scenario's outcome means: a verdict, a named skip, or an error of the run.

Only the suite decides that a scenario did not judge the connector. A skip is accepted
when it is a :class:`~kvfail.conformance.suite.SuiteSkip` naming what the connector or the
run really lacks; any other skip or xfail raised inside a scenario (by a driver, the
connector or the harness: all code the suite does not vouch for) fails it. A harness that
needs a vLLM feature the installed vLLM lacks (:class:`kvfail.compat.MissingFeatureError`)
ends the scenario in an ``error`` record, never a verdict. Each scenario's record goes to
the session's ledger, the coverage gate and the live report as it ends.
"""

from __future__ import annotations

import contextlib
import traceback
import types
from collections.abc import Generator
from typing import Any

import pytest

from kvfail.compat import MISSING_FEATURE_MARK, MissingFeatureError
from kvfail.conformance.hooks import baselines, coverage, distributed, reporting
from kvfail.conformance.hooks.state import (
    FAILURE,
    MISSING,
    PHASES,
    SKIP_NEEDS,
    STATE,
    VIOLATIONS,
    is_suite_item,
    item_key,
)
from kvfail.conformance.report import Outcome, Record

#: How a report starts where the tool, not the connector, is at fault.
HARNESS_ERROR = "harness error, not a verdict"
#: How a skip or xfail the suite did not raise is reported.
FOREIGN = "not the suite's to decide"


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def render_failure(item: pytest.Item, excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """A scenario's failure as text, built here rather than by pytest.

    Why: pytest renders a failure by parsing each frame's source file with :mod:`ast`,
    and on this Python the parser's recursion-depth counter is shared by every thread
    (the rig's and the connector's threads format tracebacks too, which parses their
    source lines). A race there raised ``SystemError: AST constructor recursion depth
    mismatch`` inside pytest's reporting, an INTERNALERROR that ended a long run. The
    frames are listed from the traceback's own line cache, which parses nothing; a
    finding's message says everything a verdict needs.
    """
    from kvfail.conformance.suite import ConformanceViolation

    exc = excinfo.value
    if isinstance(exc, ConformanceViolation):
        where = traceback.extract_tb(excinfo.tb)[-1]
        return f"{exc}\n\n(raised at {where.filename}:{where.lineno})"
    frames = traceback.extract_tb(excinfo.tb)
    # From the scenario's own frame on: pytest's and pluggy's frames above it say nothing.
    here = str(getattr(item, "path", ""))
    start = next((i for i, f in enumerate(frames) if f.filename == here), 0)
    lines = []
    for frame in frames[start:]:
        lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            lines.append(f"    {frame.line.strip()}")
    text = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return "Traceback (most recent call last):\n" + "\n".join(lines) + "\n" + text


def own_failure_rendering(item: pytest.Item) -> None:
    """Make ``item`` render its failures with :func:`render_failure`."""
    original = item.repr_failure  # type: ignore[attr-defined]

    def repr_failure(self: pytest.Item, excinfo: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(excinfo.value, (pytest.skip.Exception, pytest.fail.Exception)):
            return original(excinfo, *args, **kwargs)  # pytest's outcome text
        return render_failure(self, excinfo)

    item.repr_failure = types.MethodType(repr_failure, item)  # type: ignore[method-assign]


def _judge_skip(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """Turn a skip or xfail the suite did not raise into a failure; note what a genuine
    suite skip named."""
    from kvfail.conformance.suite import SuiteSkip

    if hasattr(report, "wasxfail"):
        reason = str(report.wasxfail)
        report.outcome = "failed"
        report.longrepr = (
            f"xfail inside a scenario ({FOREIGN}: only a baseline entry marks a known "
            f"failure): {reason}"
        )
        with contextlib.suppress(AttributeError):
            del report.wasxfail
        return
    exc = call.excinfo.value if call.excinfo is not None else None
    state = item.config.stash[STATE]
    key = item_key(item)
    caps = state.caps.get(key[0]) if key is not None else None
    if isinstance(exc, SuiteSkip) and coverage.genuine(exc.needs, caps):
        item.stash[SKIP_NEEDS] = exc.needs
        if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            # pytest names the exception's type in front of a subclass's message.
            path, lineno, _ = report.longrepr
            report.longrepr = (path, lineno, f"Skipped: {exc.msg}")
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skip inside a scenario ({FOREIGN}: a conformance skip is raised by the suite "
        f"for a capability it names, and the connector lacks): {skip_reason(report)}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if not is_suite_item(item):
        return report
    missing = _missing_feature(call, report)
    if missing is not None:
        _harness_error(item, report, missing)
    elif report.skipped:
        _judge_skip(item, call, report)
    if call.when == "call" and missing is None:
        baselines.judge(item, call, report)
    if report.skipped and not hasattr(report, "wasxfail"):
        baselines.skipped(item, report, skip_reason(report))
    if report.failed and call.excinfo is not None:
        item.stash.setdefault(FAILURE, str(call.excinfo.value).strip()[:2000])
        violations = getattr(call.excinfo.value, "violations", None)
        if violations is not None:
            item.stash[VIOLATIONS] = list(violations)
    item.stash.setdefault(PHASES, []).append((call.when, report))
    if call.when == "teardown":
        sent = record(item)
        if sent is not None:  # to the controller of a distributed run
            setattr(report, distributed.PAYLOAD_ATTR, sent)
    return report


def _missing_feature(call: pytest.CallInfo[None], report: pytest.TestReport) -> str | None:
    """The message of a :class:`MissingFeatureError` this phase ended in, wherever it
    surfaced: raised (directly, or as the cause of another error), or quoted by a skip, an
    xfail or an oracle's finding (a connector that raised it in a hook the harness
    caught). None when the phase did not meet one."""
    exc: BaseException | None = call.excinfo.value if call.excinfo is not None else None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MissingFeatureError):
            return str(exc)
        if MISSING_FEATURE_MARK in str(exc):
            return _line_with_mark(str(exc))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    xfail = str(getattr(report, "wasxfail", ""))
    if MISSING_FEATURE_MARK in xfail:
        return _line_with_mark(xfail)
    return None


def _line_with_mark(text: str) -> str:
    return next(line for line in text.splitlines() if MISSING_FEATURE_MARK in line).strip()


def _harness_error(item: pytest.Item, report: pytest.TestReport, missing: str) -> None:
    """Turn the phase into a failure of the run (never a pass, skip or xfail) and mark the
    scenario so its record is an ``error`` (see :func:`record`); no baseline applies."""
    original = "" if report.skipped else f"\n\n{report.longrepr}"
    report.outcome = "failed"
    report.longrepr = f"{HARNESS_ERROR}: {missing}{original}"
    with contextlib.suppress(AttributeError):
        del report.wasxfail
    item.stash.setdefault(MISSING, missing)


def _outcome(item: pytest.Item) -> tuple[Outcome, str]:
    missing = item.stash.get(MISSING, None)
    if missing is not None:
        return "error", f"{HARNESS_ERROR}: {missing}"
    for _when, rep in item.stash.get(PHASES, []):
        if rep.failed:
            reason = item.stash.get(FAILURE, "") or str(rep.longrepr).strip().splitlines()[-1]
            return "failed", reason
        if rep.skipped:
            if hasattr(rep, "wasxfail"):
                return "xfailed", str(rep.wasxfail)
            return "skipped", skip_reason(rep)
    return "passed", ""


def record(item: pytest.Item) -> dict[str, Any] | None:
    """The scenario's record: to the session, the coverage ledger and the live report;
    on an xdist worker, also what it sends the controller (see ``hooks.distributed``)."""
    state = item.config.stash[STATE]
    key = item_key(item)
    if key is None:
        return None
    connector, scenario, policy, layout = key
    phases = item.stash.get(PHASES, [])
    outcome, reason = _outcome(item)
    clauses = sorted(
        {str(a) for m in item.iter_markers("clauses") for a in m.args},
        key=lambda c: int(c.lstrip("C") or 0),
    )
    guards = [str(a) for m in item.iter_markers("guards") for a in m.args]
    patched = state.patches.credit(connector) if state.patches is not None else []
    violations = item.stash.get(VIOLATIONS, []) if outcome == "failed" else []
    rec = Record(
        connector=connector,
        scenario=scenario,
        policy=policy,
        layout=layout,
        outcome=outcome,
        reason=reason,
        clauses=clauses,
        duration_s=round(sum(rep.duration for _w, rep in phases), 4),
        guards=guards,
        nodeid=distributed.plain_nodeid(item),
        details={str(k): v for k, v in getattr(item, "user_properties", [])},
        violations=violations,
        rig_patches=patched,
    )
    needs = item.stash.get(SKIP_NEEDS, ())
    caps = state.caps.get(connector)
    verdict = outcome in ("passed", "xfailed") or bool(violations)
    excuse = outcome == "skipped" and coverage.excused(needs, caps)
    why = f"{outcome} ({reason.splitlines()[0][:200] if reason else 'no reason'})"
    reporting.scenario_ended(state, rec, verdict=verdict, excuse=excuse, why=why)
    if not distributed.is_worker(item.config):
        return None
    problem = None
    if connector in state.unavailable:
        problem = ("unavailable", state.unavailable[connector])
    elif connector in state.broken:
        problem = ("broken", state.broken[connector])
    entry = baselines.lookup(item, state)
    return distributed.payload(
        rec,
        caps=caps,
        verdict=verdict,
        excuse=excuse,
        why=why,
        driver_problem=problem,
        patches=state.patches.take_unsent() if state.patches is not None else [],
        baseline_stale=entry.stale if entry is not None else "",
    )
