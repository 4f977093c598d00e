"""Compare a connector alone with the guard around it, from two junit XML files.

Usage: ``python scripts/guard_verdicts.py ALONE.xml GUARDED.xml`` (each written by
``pytest <the row's files> --connector X --layout tp1 --junitxml=...``, X and guard:X; the
row's files are in :data:`ROWS`). Prints a markdown table: every scenario run either one
failed, its outcome alone and guarded, and the kinds of finding each failure named
(the suite's violation prefixes: ``C9 leak``, ``C2/C10 liveness``, ...). Exits 1 when the
guard failed a scenario that passed alone (the guard must never add a failure).

``--row X --write docs/guard.md`` writes the table, under X's heading, into the document's
section between ``<!-- guard-verdicts: X -->`` and ``<!-- /guard-verdicts: X -->``
instead of printing it: the document's tables are generated, never typed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from junit_verdicts import verdicts, write_marked

#: The rows docs/guard.md has a generated table for: ``--connector`` value -> the suite's
#: files its runs take (the store drivers' faults are in test_store_faults.py).
ROWS = {
    "vllm:MooncakeConnector": ("test_scenarios.py", "test_quarantine.py"),
    "vllm:NixlConnector": ("test_scenarios.py", "test_quarantine.py"),
    "vllm:NixlPushConnector": ("test_scenarios.py", "test_quarantine.py"),
    "vllm:ExampleConnector": ("test_scenarios.py", "test_quarantine.py", "test_store_faults.py"),
    "vllm:MultiConnector": ("test_scenarios.py", "test_quarantine.py", "test_store_faults.py"),
    "vllm:MooncakeStoreConnector": (
        "test_scenarios.py",
        "test_quarantine.py",
        "test_store_faults.py",
    ),
}
CASE = re.compile(r"^(?P<scenario>\w+)\[.*?-(?P<policy>fail|recompute)(?:-(?P<case>.+))?\]$")


def outcomes(path: Path) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """(scenario, policy) -> (outcome, finding kinds) for one run."""
    out: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for name, verdict in verdicts(path).items():
        match = CASE.match(name)
        if match is None:
            continue
        scenario = match["scenario"] + (f"[{match['case']}]" if match["case"] else "")
        out[(scenario, match["policy"])] = (verdict.outcome, list(verdict.kinds))
    return out


def table(alone_path: str, guarded_path: str) -> tuple[list[str], int]:
    """The markdown table's lines and how many scenarios the guard added a failure to."""
    alone, guarded = outcomes(Path(alone_path)), outcomes(Path(guarded_path))
    lines = [
        "| scenario | policy | alone | guarded | findings alone | findings guarded |",
        "|---|---|---|---|---|---|",
    ]
    added = []
    for key in sorted(set(alone) | set(guarded)):
        a, g = alone.get(key, ("not run", [])), guarded.get(key, ("not run", []))
        if a[0] == "passed" and g[0] in ("failed", "error"):
            added.append(key)
        if "failed" not in (a[0], g[0]) and "error" not in (a[0], g[0]):
            continue
        lines.append(
            f"| {key[0]} | {key[1]} | {a[0]} | {g[0]} | {', '.join(a[1])} | {', '.join(g[1])} |"
        )
    fixed = sum(
        1 for k in alone if alone[k][0] == "failed" and guarded.get(k, ("",))[0] == "passed"
    )
    lines += [
        "",
        f"Failed alone, passed guarded: {fixed}. Passed alone, failed guarded: {len(added)}.",
    ]
    return lines, len(added)


def write_section(doc: Path, row: str, lines: list[str]) -> None:
    """Replace ``row``'s marked section of ``doc`` with its heading and ``lines``."""
    files = ", ".join(f"`conformance/{f}`" for f in ROWS[row])
    write_marked(doc, f"guard-verdicts: {row}", [f"### `{row}` (tp1; {files})", "", *lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("alone")
    ap.add_argument("guarded")
    ap.add_argument("--row", choices=sorted(ROWS), help="the row the two runs are of")
    ap.add_argument("--write", type=Path, help="write into this document (needs --row)")
    args = ap.parse_args(argv)
    lines, added = table(args.alone, args.guarded)
    if args.write is None:
        print("\n".join(lines))
    elif args.row is None:
        ap.error("--write needs --row")
    else:
        write_section(args.write, args.row, lines)
    return 1 if added else 0


if __name__ == "__main__":
    sys.exit(main())
