"""Compare a connector alone with the guard around it, from two junit XML files.

Usage: ``python scripts/guard_verdicts.py ALONE.xml GUARDED.xml`` (each written by
``pytest conformance/test_scenarios.py conformance/test_quarantine.py --connector X
--layout tp1 --junitxml=...``). Prints a markdown table: every scenario run either one
failed, its outcome alone and guarded, and the kinds of finding each failure named
(the suite's violation prefixes: ``C9 leak``, ``C2/C10 liveness``, ...). Exits 1 when the
guard failed a scenario that passed alone (the guard must never add a failure).
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: A violation's prefix in a scenario's failure message ("C9 leak: ...").
FINDING = re.compile(r"\b(C\d+(?:/C\d+)*) ([A-Za-z][A-Za-z /-]*?):")
CASE = re.compile(r"^(?P<scenario>\w+)\[.*?-(?P<policy>fail|recompute)(?:-(?P<case>.+))?\]$")


def outcomes(path: Path) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """(scenario, policy) -> (outcome, finding kinds) for one run."""
    out: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        match = CASE.match(case.get("name", ""))
        if match is None:
            continue
        scenario = match["scenario"] + (f"[{match['case']}]" if match["case"] else "")
        key = (scenario, match["policy"])
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            text = failure.get("message", "") + (failure.text or "")
            kinds = sorted({f"{c} {k}" for c, k in FINDING.findall(text)})
            out[key] = ("failed" if failure.tag == "failure" else "error", kinds)
        elif case.find("skipped") is not None:
            out[key] = ("skipped", [])
        else:
            out[key] = ("passed", [])
    return out


def main(alone_path: str, guarded_path: str) -> int:
    alone, guarded = outcomes(Path(alone_path)), outcomes(Path(guarded_path))
    print("| scenario | policy | alone | guarded | findings alone | findings guarded |")
    print("|---|---|---|---|---|---|")
    added = []
    for key in sorted(set(alone) | set(guarded)):
        a, g = alone.get(key, ("not run", [])), guarded.get(key, ("not run", []))
        if a[0] == "passed" and g[0] in ("failed", "error"):
            added.append(key)
        if "failed" not in (a[0], g[0]) and "error" not in (a[0], g[0]):
            continue
        print(f"| {key[0]} | {key[1]} | {a[0]} | {g[0]} | {', '.join(a[1])} | {', '.join(g[1])} |")
    fixed = sum(
        1 for k in alone if alone[k][0] == "failed" and guarded.get(k, ("",))[0] == "passed"
    )
    print(f"\nFailed alone, passed guarded: {fixed}. Passed alone, failed guarded: {len(added)}.")
    return 1 if added else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
