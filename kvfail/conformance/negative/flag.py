"""What the self-test expects of a negative control, and how it reads a verdict.

Why apart from the controls: the self-test and the docs test read the expectations
without building a connector, and this module imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Flag", "findings_text", "flags", "reference_problems"]


class Flag(NamedTuple):
    """Where the self-test expects a control to be flagged, and for what."""

    scenario: str
    #: Text the scenario's failure must contain (the clause first).
    clause: str
    #: The policies under which the scenario must flag it.
    policies: frozenset[str] = frozenset({"fail", "recompute"})


def flags(record: Mapping[str, Any], flag: Flag) -> bool:
    """Whether one ``report.json`` record is ``flag``: the scenario's verdict of failure,
    for the flag's reason. A harness error (``outcome == "error"``: the installed vLLM
    lacks a feature the tool needs) never is, whatever its message says: the control was
    not judged."""
    return (
        record.get("outcome") == "failed"
        and record.get("scenario") == flag.scenario
        and record.get("policy") in flag.policies
        and flag.clause in findings_text(record)
    )


def findings_text(record: Mapping[str, Any]) -> str:
    """Every finding of a failed record: its ``violations`` where the report has them
    (the ``reason`` is capped, and a stuck load's evidence can push later findings past
    the cap), else its reason."""
    found = record.get("violations") or []
    return "; ".join(str(v) for v in found) or str(record.get("reason", ""))


def reference_problems(records: Sequence[Mapping[str, Any]], flag: Flag) -> list[str]:
    """Why a reference's runs of ``flag``'s scenario are no ground for the flag (empty:
    they are). Each run must have been judged (passed or failed, never an error or a
    skip) and none may carry the control's own finding. A reference may fail the
    scenario for another reason: the real transports under load can show an unrelated
    race in upstream's code, and the flag stays evidence as long as the breakage is what
    tells the control from its reference."""
    mine = [r for r in records if r.get("scenario") == flag.scenario]
    if not mine:
        return [f"the reference did not run {flag.scenario}"]
    problems = []
    for r in mine:
        where = f"{r.get('scenario')} [{r.get('policy')}]"
        if r.get("outcome") not in ("passed", "failed"):
            problems.append(f"{where} was not judged: {r.get('outcome')} {r.get('reason', '')}")
        elif flags(r, flag):
            problems.append(f"{where} shows the control's own finding: {r.get('reason', '')}")
    return problems
