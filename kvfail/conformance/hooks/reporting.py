"""The run's report: the matrix on the terminal, and report files kept whole throughout.

Why written as the run goes: a long run that ends badly (an INTERNALERROR inside pytest,
Ctrl-C, SIGTERM, a budget) must keep every verdict it reached. ``records.jsonl`` gets each
record as its scenario ends, and ``report.json`` / ``report.md`` are rewritten atomically
after each scenario; the session's end (whatever its status: pytest skips the terminal
summary after an INTERNALERROR) finishes them, and ``pytest_unconfigure`` does if the
session's end never came.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfail.conformance.hooks.state import STATE, SessionState
from kvfail.conformance.report import (
    Record,
    append_record,
    render_durations,
    render_matrix,
    render_patches,
    write_report,
)

_CAPABILITIES_SHOWN = (
    "async_load",
    "sync_load",
    "request_level_failures",
    "block_level_failures",
    "hma",
    "real_transport",
    "tp2",
    "hetero_tp",
    "byte_verification",
)


def scenario_ended(
    state: SessionState, record: Record, *, verdict: bool, excuse: bool, why: str
) -> None:
    """One more record: into the session's list and the coverage ledger (``verdict``: it
    ran to one; ``excuse``: it skipped for an optional capability; ``why``: what happened
    otherwise), then into the files."""
    state.records.append(record)
    state.coverage.note(
        record.connector, record.scenario, record.clauses, verdict=verdict, excuse=excuse, why=why
    )
    if not state.report_dir:
        return
    append_record(state.report_dir, record)
    write(state, final=False)


def write(state: SessionState, *, final: bool) -> tuple[str, str] | None:
    """(Re)write the report files; once ``final``, later calls leave them alone."""
    if not state.report_dir or state.report_final:
        return None
    patches = state.patches.summary(read=final) if state.patches is not None else []
    caps_json = {spec: c.as_dict() for spec, c in state.caps.items()}
    coverage = {"verdicts": state.coverage.as_dict(), "unverified": list(state.unverified)}
    json_path, md_path = write_report(
        state.report_dir, state.records, caps_json, rig_patches=patches, coverage=coverage
    )
    state.report_final = final
    return str(json_path), str(md_path)


def finish(config: pytest.Config) -> None:
    """The session ended, however: the report's final form."""
    state = config.stash.get(STATE, None)
    if state is None:
        return
    try:
        write(state, final=True)
    except Exception as exc:  # never mask the session's own outcome
        print(f"kvfail: could not finish the report in {state.report_dir}: {exc!r}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is None or not state.records or hasattr(config, "workerinput"):
        return  # an xdist worker's share is the controller's to show
    from kvfail.conformance.hooks import baselines

    tr = terminalreporter
    tr.write_sep("=", "kvfail conformance matrix (clauses: docs/contract.md)")
    for spec, caps in state.caps.items():
        have = [n for n in _CAPABILITIES_SHOWN if getattr(caps, n)]
        driver = state.drivers.get(spec)
        chosen = getattr(driver, "chosen", "")
        why = f" ({type(driver).__name__}: {chosen})" if chosen else ""
        tr.write_line(
            f"{spec}: {caps.connector} via driver {caps.driver}{why}; has {', '.join(have)}"
        )
    for spec, why in state.unavailable.items():
        tr.write_line(f"{spec}: driver unavailable: {why}")
    for spec, why in state.broken.items():
        tr.write_line(f"{spec}: DRIVER BROKEN: {why}")
    tr.write_line("")
    tr.write_line(render_matrix(state.records))
    for line in baselines.summary(state):
        tr.write_line(line)
    if state.write_baseline:
        tr.write_line(f"kvfail baseline written: {baselines.write(state)}")
    patches = state.patches.summary() if state.patches is not None else []
    tr.write_sep("-", "kvfail rig patches (docs/rig-patches.md)")
    tr.write_line(render_patches(patches))
    tr.write_sep("-", "kvfail scenario durations")
    tr.write_line(render_durations(state.records))
    if state.unverified:
        tr.write_sep("-", "kvfail coverage: clauses without a verdict (the run fails)")
        for line in state.unverified:
            tr.write_line(line, red=True)
    if state.report_dir:
        tr.write_line(f"kvfail report: {state.report_dir}/report.json {state.report_dir}/report.md")
