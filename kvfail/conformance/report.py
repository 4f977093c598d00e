"""The per-connector compliance matrix, as text for the terminal and as report files.

Why: a connector author (and a reviewer comparing connectors) needs one table per
connector saying, for each scenario and policy, passed / failed / skipped (with the
missing capability) / xfailed (with the known finding), plus the clause each row tests.
``report.json`` is the machine-readable form (one record per scenario x policy) and
``report.md`` the rendered matrix, as ADBC's generated support tables. The clauses are
defined in ``docs/contract.md``. A verdict reached on a patched system must say so: each
record names the rig patches its connector ran under, and ``rig_patches.json`` and
``report.md`` describe them (``docs/rig-patches.md``). ``records.jsonl`` gets each record
as its scenario ends, so what a run stopped early (a budget, SIGKILL) had finished is kept;
a reader such as ``kvfail audit`` needs nothing but these files.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "OUTCOMES",
    "RECORDS_FILE",
    "Outcome",
    "Record",
    "append_record",
    "render_durations",
    "render_matrix",
    "render_patches",
    "write_atomically",
    "write_report",
]

#: ``error``: the tool could not judge (a :class:`kvfail.compat.MissingFeatureError`: the
#: installed vLLM lacks what the harness needs). Never a verdict on the connector: not a
#: pass, not a skip, not a failure a negative control may be "flagged" by.
Outcome = Literal["passed", "failed", "skipped", "xfailed", "error"]
OUTCOMES: tuple[Outcome, ...] = ("passed", "failed", "skipped", "xfailed", "error")


@dataclass
class Record:
    """One scenario under one policy for one connector."""

    connector: str
    scenario: str
    policy: str
    outcome: Outcome
    reason: str
    clauses: list[str]
    duration_s: float
    guards: list[str] = field(default_factory=list)
    nodeid: str = ""
    #: Measurements the scenario noted (e.g. ``detected_s``: add -> first report).
    details: dict[str, Any] = field(default_factory=dict)
    #: Engine layout (``tp1``, ``tp2-g2``, ``p2d1``, ...; see ``layout.py``).
    layout: str = "tp1"
    #: The oracles' findings, clause first, when the scenario failed on them.
    violations: list[str] = field(default_factory=list)
    #: Rig patches (:data:`kvfail.rig.patches.CATALOGUE` names) this connector ran under
    #: by the end of this scenario.
    rig_patches: list[str] = field(default_factory=list)


def _cell(record: Record | None) -> str:
    if record is None:
        return "-"
    return record.outcome


def render_matrix(records: Iterable[Record], *, markdown: bool = False) -> str:
    """One table per connector: scenario rows, policy columns, clauses and reasons."""
    by_connector: dict[str, list[Record]] = {}
    for r in records:
        by_connector.setdefault(r.connector, []).append(r)
    lines: list[str] = []
    for connector, recs in by_connector.items():
        # One column per policy; per policy and layout when several layouts ran.
        several = len({r.layout for r in recs}) > 1
        column = (lambda r: f"{r.policy} {r.layout}") if several else (lambda r: r.policy)
        policies = sorted({column(r) for r in recs}, key=lambda c: (c.split()[1:], c))
        scenarios = list(dict.fromkeys(r.scenario for r in recs))
        index = {(r.scenario, column(r)): r for r in recs}
        counts = {o: sum(r.outcome == o for r in recs) for o in OUTCOMES}
        summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
        header = ["scenario", "clauses", *policies]
        rows = []
        notes: list[str] = []
        for s in scenarios:
            some = next(index[(s, p)] for p in policies if (s, p) in index)
            rows.append([s, " ".join(some.clauses), *(_cell(index.get((s, p))) for p in policies)])
            for p in policies:
                r = index.get((s, p))
                if r is not None and r.outcome != "passed" and r.reason:
                    notes.append(f"{s}[{p}] {r.outcome}: {r.reason}")
        if markdown:
            lines.append(f"## {connector} ({summary})\n")
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + "---|" * len(header))
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            if notes:
                lines.append("")
                lines += [f"- {n}" for n in notes]
            lines.append("")
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
            lines.append(f"kvfail conformance: {connector} ({summary})")
            fmt = "  ".join(f"{{:<{w}}}" for w in widths)
            lines.append(fmt.format(*header))
            lines += [fmt.format(*row) for row in rows]
            lines += [f"  {n}" for n in notes]
            lines.append("")
    return "\n".join(lines)


def render_durations(records: Iterable[Record]) -> str:
    """Per-scenario durations, slowest first, summed per connector."""
    recs = sorted(records, key=lambda r: -r.duration_s)
    totals: dict[str, float] = {}
    for r in recs:
        totals[r.connector] = totals.get(r.connector, 0.0) + r.duration_s
    lines = [
        f"  {r.duration_s:7.3f}s  {r.connector} {r.scenario}[{r.policy} {r.layout}]"
        + "".join(f"  {k}={v}" for k, v in r.details.items())
        for r in recs
    ]
    lines += [f"  {t:7.3f}s  total {c}" for c, t in totals.items()]
    return "\n".join(lines)


def render_patches(patches: Iterable[Mapping[str, Any]]) -> str:
    """The rig patches applied in a run (``kvfail.rig.patches.summarize``), one block each."""
    patches = list(patches)
    if not patches:
        return "none recorded: the system under test ran unpatched"
    lines = []
    for p in patches:
        who = ", ".join(p.get("connectors") or []) or "-"
        touches = (
            "touches the connector under test"
            if p["touches_connector"]
            else "the rig's P processes only"
        )
        lines.append(
            f"{p['name']}: {p['target']} ({touches}); applied {p['applied']}x in "
            f"{p['processes']} process(es) [{', '.join(p['where'])}]; connectors: {who}"
        )
        lines.append(f"    changes: {p['change']}")
        lines.append(f"    why: {p['why']}")
        lines.append(f"    without it: {p['without']}")
    return "\n".join(lines)


#: One JSON line per finished scenario, appended as it ends (see :func:`append_record`).
RECORDS_FILE = "records.jsonl"


def append_record(directory: str | Path, record: Record) -> None:
    """Add ``record`` to ``records.jsonl`` in ``directory`` (one line, written whole)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with (out / RECORDS_FILE).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(asdict(record), default=str) + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader, or a run killed mid-write,
    sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(
    directory: str | Path,
    records: Iterable[Record],
    capabilities: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    rig_patches: Iterable[Mapping[str, Any]] = (),
    coverage: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``report.json`` (records), ``report.md`` (matrix), ``capabilities.json``,
    ``rig_patches.json`` and, when given, ``coverage.json`` (the clauses each connector
    was judged on: ``verdicts``, and the ``unverified`` lines), each replaced atomically;
    returns the first two paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    recs = list(records)
    json_path, md_path = out / "report.json", out / "report.md"
    write_atomically(json_path, json.dumps([asdict(r) for r in recs], indent=2) + "\n")
    patches = [dict(p) for p in rig_patches]
    md = [
        "# kvfail conformance report\n",
        "Clauses (C1-C14) as defined in `docs/contract.md` of kvfail.\n",
        render_matrix(recs, markdown=True),
    ]
    md.append("## Rig patches\n")
    if patches:
        md.append("What the rig changed in the system under test (`docs/rig-patches.md`):\n")
        md.append("| patch | target | changes | touches the connector | applied | connectors |")
        md.append("|---|---|---|---|---|---|")
        for p in patches:
            md.append(
                f"| `{p['name']}` | `{p['target']}` | {p['change']} | "
                f"{'yes' if p['touches_connector'] else 'no'} | {p['applied']}x in "
                f"{p['processes']} process(es) | {', '.join(p.get('connectors') or []) or '-'} |"
            )
        md.append("")
    else:
        md.append("None recorded: the system under test ran unpatched.\n")
    if capabilities:
        md.append("## Capabilities\n")
        for connector, caps in capabilities.items():
            md.append(f"### {connector}\n")
            md.append("| capability | value | why |")
            md.append("|---|---|---|")
            reasons = caps.get("reasons", {})
            for key, value in caps.items():
                if key in ("reasons", "connector", "driver"):
                    continue
                md.append(f"| {key} | {value} | {reasons.get(key, '')} |")
            md.append("")
    if coverage is not None:
        md.append("## Coverage\n")
        unverified = list(coverage.get("unverified", []))
        md += [f"- **{line}**" for line in unverified] or ["Every required clause was judged."]
        md.append("")
    write_atomically(md_path, "\n".join(md) + "\n")
    write_atomically(out / "capabilities.json", json.dumps(capabilities or {}, indent=2) + "\n")
    write_atomically(out / "rig_patches.json", json.dumps(patches, indent=2) + "\n")
    if coverage is not None:
        write_atomically(out / "coverage.json", json.dumps(dict(coverage), indent=2) + "\n")
    return json_path, md_path
