"""Known violations a user chooses to accept: ``--kvfail-baseline FILE``.

Why a file and not a table in the code: a verdict must come from what a connector does.
A table keyed by class name gave an unmodified subclass of upstream's connector another
verdict than upstream's, for the same behaviour. A baseline is a claim the user makes and
passes explicitly; each entry pins one exact (connector class, scenario, policy, layout)
to the clauses it is expected to break (clauses as ``docs/contract.md`` defines them), so
that:

* a failure is absorbed (reported as ``xfailed``) only when it is a
  :class:`~kvfail.conformance.suite.ConformanceViolation` whose every violation cites
  clauses the entry names; an error, or a violation of another clause, still fails;
* an entry whose scenario now passes is reported as *fixed*, and fails the run until it is
  removed (a baseline only ever shrinks);
* without a baseline, every violation is a failure.

The file is TOML::

    [[known]]
    connector = "pkg.module:ConnectorClass"   # the class, module:qualname
    scenario = "test_silent_peer_caught_by_deadline"
    policy = "fail"
    layout = "tp1"
    clauses = ["C10"]
    reason = "what breaks, in a sentence"       # optional

``--kvfail-write-baseline FILE`` writes one from a run's violations.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Baseline",
    "BaselineError",
    "Entry",
    "clauses_of",
    "render_baseline",
]

#: A clause citation at the head of a violation: ``C10``, ``C2/C10``.
_CITATION = re.compile(r"\bC\d+(?:/C\d+)*\b")
_KEYS = ("connector", "scenario", "policy", "layout")


class BaselineError(ValueError):
    """The baseline file cannot be used (message says where and why)."""


def clauses_of(violation: str) -> frozenset[str]:
    """The clauses one violation cites first (``"C2/C10 liveness: ..."`` -> C2, C10); empty
    when it cites none, which no baseline entry can absorb."""
    found = _CITATION.search(violation)
    return frozenset(found.group(0).split("/")) if found else frozenset()


@dataclass
class Entry:
    """One accepted violation, pinned to its clauses."""

    connector: str
    scenario: str
    policy: str
    layout: str
    clauses: frozenset[str]
    reason: str = ""
    #: Set during the run: the entry's scenario ran and failed as the entry says.
    matched: bool = False

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.connector, self.scenario, self.policy, self.layout)

    def absorbs(self, violations: Iterable[str]) -> list[str]:
        """The violations this entry does NOT cover (empty: it absorbs all of them)."""
        out = []
        for v in violations:
            cited = clauses_of(v)
            if not cited or not cited <= self.clauses:
                out.append(v)
        return out

    def describe(self) -> str:
        return (
            f"{self.connector} {self.scenario} [{self.policy}, {self.layout}] "
            f"expects {', '.join(sorted(self.clauses, key=_clause_order))}"
        )


def _clause_order(clause: str) -> int:
    return int(clause.lstrip("C") or 0)


@dataclass
class Baseline:
    """The entries of one baseline file, looked up by exact key."""

    path: str
    entries: dict[tuple[str, str, str, str], Entry] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Baseline:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise BaselineError(f"cannot read baseline {p}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise BaselineError(f"baseline {p} is not valid TOML: {exc}") from exc
        known = data.get("known", [])
        if not isinstance(known, list):
            raise BaselineError(f"baseline {p}: 'known' must be an array of tables")
        out = cls(str(p))
        for n, raw in enumerate(known, 1):
            where = f"baseline {p}, entry {n}"
            if not isinstance(raw, dict):
                raise BaselineError(f"{where}: not a table")
            missing = [k for k in (*_KEYS, "clauses") if k not in raw]
            if missing:
                raise BaselineError(f"{where}: missing {', '.join(missing)}")
            clauses = raw["clauses"]
            if (
                not isinstance(clauses, list)
                or not clauses
                or not all(isinstance(c, str) and re.fullmatch(r"C\d+", c) for c in clauses)
            ):
                raise BaselineError(f"{where}: clauses must be a non-empty list like ['C10']")
            if ":" not in str(raw["connector"]):
                raise BaselineError(
                    f"{where}: connector must be the exact class, module:qualname "
                    f"(got {raw['connector']!r})"
                )
            entry = Entry(
                connector=str(raw["connector"]),
                scenario=str(raw["scenario"]),
                policy=str(raw["policy"]),
                layout=str(raw["layout"]),
                clauses=frozenset(clauses),
                reason=str(raw.get("reason", "")),
            )
            if entry.key in out.entries:
                raise BaselineError(f"{where}: duplicates an earlier entry ({entry.describe()})")
            out.entries[entry.key] = entry
        return out

    def lookup(self, connector: str, scenario: str, policy: str, layout: str) -> Entry | None:
        return self.entries.get((connector, scenario, policy, layout))


def render_baseline(entries: Iterable[Entry]) -> str:
    """TOML text for ``entries`` (what ``--kvfail-write-baseline`` writes)."""
    lines = [
        "# kvfail conformance baseline: known violations, each pinned to its clauses.",
        "# Pass it with --kvfail-baseline; an entry that no longer fails fails the run.",
    ]
    for e in sorted(entries, key=lambda e: e.key):
        lines += [
            "",
            "[[known]]",
            f"connector = {_toml_str(e.connector)}",
            f"scenario = {_toml_str(e.scenario)}",
            f"policy = {_toml_str(e.policy)}",
            f"layout = {_toml_str(e.layout)}",
            "clauses = ["
            + ", ".join(_toml_str(c) for c in sorted(e.clauses, key=_clause_order))
            + "]",
        ]
        if e.reason:
            lines.append(f"reason = {_toml_str(e.reason)}")
    return "\n".join(lines) + "\n"


def _toml_str(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{escaped}"'
