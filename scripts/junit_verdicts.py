"""A scenario run's verdicts, read from pytest's junit XML: one parser for the scripts that
compare two runs (:mod:`guard_verdicts`: a connector alone and guarded; :mod:`verdict_diff`:
the same connectors before and after a change).

A verdict is the run's outcome for one test and the kinds of finding its failure named, by
the suite's violation prefixes (``C9 leak``, ``C2/C10 liveness``, ...): two failures of one
scenario that name different clauses are different verdicts.
"""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from pathlib import Path

#: A violation's prefix in a scenario's failure message ("C9 leak: ...").
FINDING = re.compile(r"\b(C\d+(?:/C\d+)*) ([A-Za-z][A-Za-z /-]*?):")


@dataclasses.dataclass(frozen=True)
class Verdict:
    outcome: str  # passed | failed | error | skipped | xfailed
    kinds: tuple[str, ...] = ()


def verdict_of(case: ET.Element) -> Verdict:
    """The verdict of one ``<testcase>``."""
    failure = case.find("failure")
    if failure is None:
        failure = case.find("error")
    if failure is not None:
        text = failure.get("message", "") + (failure.text or "")
        kinds = tuple(sorted({f"{c} {k}" for c, k in FINDING.findall(text)}))
        return Verdict("failed" if failure.tag == "failure" else "error", kinds)
    skipped = case.find("skipped")
    if skipped is not None:
        return Verdict("xfailed" if skipped.get("type") == "pytest.xfail" else "skipped")
    return Verdict("passed")


def verdicts(path: Path) -> dict[str, Verdict]:
    """Test name (function and parameters) -> verdict, for every test of one run.

    Keyed by name, not by module, so a scenario that moved to another module between two
    runs is still the same scenario. A setup error and the test's own outcome share a
    name; the worse one is kept.
    """
    out: dict[str, Verdict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name, verdict = case.get("name", ""), verdict_of(case)
        if name not in out or out[name].outcome in ("passed", "skipped"):
            out[name] = verdict
    return out
