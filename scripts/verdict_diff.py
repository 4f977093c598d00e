"""Did a change alter any verdict? Compare two runs of the suite, from their junit XML.

Usage::

    python scripts/verdict_diff.py BEFORE.xml AFTER.xml [--labels A B]
        [--output FILE | --write DOC.md --section NAME]

Each file is written by the same ``pytest ... --connector X [--connector Y ...]
--junitxml=FILE`` at two commits. A test is matched by its name (scenario and
parameters: connector, layout, policy), so a scenario that moved module is still matched.
Prints (or writes) a markdown report: how many tests agree, every test whose outcome or
named finding kinds differ, and the tests only one run has (new, removed or renamed
scenarios, which a reader must account for). Exits 1 when an outcome differs.
``--write DOC --section NAME`` puts the report between ``<!-- NAME -->`` and
``<!-- /NAME -->`` in DOC (``docs/verdicts-before-after.md``'s tables are written so).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from junit_verdicts import Verdict, verdicts, write_marked


def _cell(v: Verdict) -> str:
    return v.outcome + (f" ({', '.join(v.kinds)})" if v.kinds else "")


def report(before: Path, after: Path, labels: tuple[str, str]) -> tuple[list[str], int]:
    """The report's lines and how many tests changed outcome."""
    a, b = verdicts(before), verdicts(after)
    both = sorted(set(a) & set(b))
    changed = [n for n in both if a[n].outcome != b[n].outcome]
    reworded = [n for n in both if a[n].outcome == b[n].outcome and a[n].kinds != b[n].kinds]
    tally = Counter(a[n].outcome for n in both if n not in changed)
    lines = [
        f"Tests in both runs: {len(both)}; same outcome: {len(both) - len(changed)} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(tally.items()))}); "
        f"outcome changed: {len(changed)}; same outcome, other finding kinds: {len(reworded)}.",
    ]
    for title, names in (("Outcome changed", changed), ("Finding kinds changed", reworded)):
        if names:
            lines += [
                "",
                f"### {title}",
                "",
                f"| test | {labels[0]} | {labels[1]} |",
                "|---|---|---|",
            ]
            lines += [f"| `{n}` | {_cell(a[n])} | {_cell(b[n])} |" for n in names]
    for label, only, run in ((labels[0], set(a) - set(b), a), (labels[1], set(b) - set(a), b)):
        if only:
            lines += [
                "",
                f"### Only in {label} ({len(only)})",
                "",
                "| test | outcome |",
                "|---|---|",
            ]
            lines += [f"| `{n}` | {_cell(run[n])} |" for n in sorted(only)]
    return lines, len(changed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--labels", nargs=2, default=("before", "after"), metavar=("A", "B"))
    ap.add_argument("--output", type=Path, help="write the report here instead of stdout")
    ap.add_argument("--write", type=Path, help="write into this document's marked section")
    ap.add_argument("--section", help="the section's marker name (with --write)")
    args = ap.parse_args(argv)
    lines, changed = report(args.before, args.after, tuple(args.labels))
    text = "\n".join(lines) + "\n"
    if args.write is not None:
        if not args.section:
            ap.error("--write needs --section")
        write_marked(args.write, args.section, lines)
    elif args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
