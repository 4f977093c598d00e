"""Applying the user's baseline (``--kvfail-baseline``) to each scenario, and writing one
(``--kvfail-write-baseline``). The file's format and the fingerprint of a finding are
:mod:`kvfail.conformance.baseline`'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfail.conformance.baseline import Entry, entry_for, render_baseline
from kvfail.conformance.hooks.state import STATE, SessionState, item_key


def lookup(item: pytest.Item, state: SessionState) -> Entry | None:
    """The entry for this scenario run, by the exact class its driver runs."""
    key = item_key(item)
    if state.baseline is None or key is None:
        return None
    caps = state.caps.get(key[0])
    if caps is None:
        return None
    return state.baseline.lookup(caps.connector_path, *key[1:])


def judge(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """Apply the baseline to one scenario's call phase.

    Only a :class:`ConformanceViolation` whose every finding has a fingerprint the entry
    lists is absorbed; an error, or a finding of another check, fails as it would without
    the entry. An entry whose scenario passed is *fixed* and fails the run until removed.
    """
    state = item.config.stash[STATE]
    entry = lookup(item, state)
    if entry is None or state.baseline is None:
        return
    if report.passed:
        entry.stale = "the scenario passed"
        report.outcome = "failed"
        report.longrepr = (
            f"baseline entry fixed: {entry.describe()} expects {entry.expects()}, but the "
            f"scenario passed; remove the entry from {state.baseline.path}"
        )
        return
    if not report.failed or call.excinfo is None:
        return
    from kvfail.conformance.suite import ConformanceViolation

    exc = call.excinfo.value
    if not isinstance(exc, ConformanceViolation):
        return  # an error inside the scenario is never a known violation
    uncovered = entry.absorbs(exc.violations)
    if uncovered:
        report.longrepr = (
            f"{report.longrepr}\n\nbaseline entry {entry.describe()} (expects "
            f"{entry.expects()}) does not cover: " + "; ".join(uncovered)
        )
        return
    entry.matched = True
    report.outcome = "skipped"
    report.wasxfail = f"baseline: {entry.reason or entry.describe()} | observed: " + "; ".join(
        exc.violations
    )


def skipped(item: pytest.Item, report: pytest.TestReport, reason: str) -> None:
    """A baselined scenario that skipped: the entry is *stale* (it no longer describes a
    run), and fails the run the way a fixed one does."""
    state = item.config.stash[STATE]
    entry = lookup(item, state)
    if entry is None or state.baseline is None:
        return
    entry.stale = f"the scenario skipped ({reason})"
    report.outcome = "failed"
    report.longrepr = (
        f"baseline entry stale: {entry.describe()} expects {entry.expects()}, but the "
        f"scenario skipped ({reason}); remove the entry from {state.baseline.path}"
    )


def summary(state: SessionState) -> list[str]:
    """What became of the baseline's entries in this run."""
    if state.baseline is None:
        return []
    entries = list(state.baseline.entries.values())
    matched = [e for e in entries if e.matched]
    stale = [e for e in entries if e.stale]
    ran = {c.connector_path for c in state.caps.values()}
    idle = [e for e in entries if not e.matched and not e.stale and e.connector in ran]
    out = [
        f"kvfail baseline {state.baseline.path}: {len(matched)} of {len(entries)} entries "
        f"matched by their fingerprints in this run"
    ]
    out += [f"  stale: {e.describe()}: {e.stale}" for e in stale]
    if idle:
        out.append(f"  {len(idle)} entries of classes in this run were not selected to run")
    return out


def write(state: SessionState) -> str:
    """One entry per scenario run that failed on the oracles' findings, every finding
    citing a clause (an error, or a finding with no clause, is not a known violation);
    entries of the baseline in use that absorbed this run's failures are kept."""
    entries = []
    for r in state.records:
        caps = state.caps.get(r.connector)
        if caps is None:
            continue
        if r.outcome == "xfailed" and state.baseline is not None:
            kept = state.baseline.lookup(caps.connector_path, r.scenario, r.policy, r.layout)
            if kept is not None:
                entries.append(kept)
            continue
        if r.outcome != "failed":
            continue
        entry = entry_for(caps.connector_path, r.scenario, r.policy, r.layout, r.violations)
        if entry is not None:
            entries.append(entry)
    path = Path(state.write_baseline or "baseline.toml")
    path.write_text(render_baseline(entries), encoding="utf-8")
    return str(path)
