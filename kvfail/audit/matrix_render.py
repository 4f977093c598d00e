"""The ``kvfail matrix`` table as text: a plain table, Markdown or JSON, and the heat map."""

from __future__ import annotations

import json
from pathlib import Path

from kvfail.audit.matrix_table import Matrix

__all__ = ["render_heatmap", "render_table"]


def _rows(matrix: Matrix) -> tuple[list[str], list[list[str]]]:
    header = ["connector", *[f"vLLM {v}" for v in matrix.versions]]
    body = [
        [name, *[matrix.cell(name, v).text(matrix.dynamic) for v in matrix.versions]]
        for name in matrix.connectors
    ]
    return header, body


def render_table(matrix: Matrix, fmt: str = "table") -> str:
    """The connector x version table: text (``table``), ``markdown`` or ``json``."""
    if fmt == "json":
        return json.dumps(matrix.to_json(), indent=2)
    header, body = _rows(matrix)
    lines: list[str] = []
    if fmt == "markdown":
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += [
            "| " + " | ".join(f"`{c}`" if i else c for i, c in enumerate(r)) + " |" for r in body
        ]
    else:
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body
        ]
    lines.append("")
    lines.append(
        "cell: static checks failed (ids as in `kvfail audit`; ok = none)"
        + (
            " ; dynamic scenarios (ok n/n, FAIL k/n; +k error: the tool could not judge them"
            " on that vLLM, a missing feature; - = no driver)"
            if matrix.dynamic
            else ""
        )
        + "; absent = not in that vLLM"
    )
    for r in matrix.runs:
        if r.features is not None:
            have = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in r.features.items())
            lines.append(f"vLLM {r.version} features: {have}")
    for r in matrix.runs:
        if r.error:
            lines.append(f"vLLM {r.version}: ERROR {r.error}")
        elif r.dynamic_incomplete:
            lines.append(f"vLLM {r.version}: dynamic tier incomplete: {r.dynamic_incomplete}")
    return "\n".join(lines) + "\n"


def render_heatmap(matrix: Matrix, path: Path) -> None:
    """Draw the matrix as a PNG (:mod:`kvfail.audit.heatmap`: one colour per verdict)."""
    from kvfail.audit.heatmap import render

    render(matrix, path)
