"""Known violations a user chooses to accept: ``--kvfail-baseline FILE``.

Why a file and not a table in the code: a verdict must come from what a connector does.
A table keyed by class name gave an unmodified subclass of upstream's connector another
verdict than upstream's, for the same behaviour. A baseline is a claim the user makes and
passes explicitly; each entry pins one exact (connector class, scenario, policy, layout)
to the *fingerprints* of the findings it is expected to produce. A fingerprint is the
finding's clauses, the check that found it and the stage of the scenario it was found in
(see :func:`fingerprint`), so that:

* a failure is absorbed (reported as ``xfailed``) only when it is a
  :class:`~kvfail.conformance.suite.ConformanceViolation` whose every finding has a
  fingerprint the entry lists; an error, or a finding of another check (even of the same
  clause: a wrong-KV finding next to a known liveness one), still fails;
* an entry whose scenario now passes is *fixed*, and one whose scenario skipped is
  *stale*: both fail the run until the entry is removed (a baseline only ever shrinks);
* without a baseline, every violation is a failure.

The file is TOML::

    [[known]]
    connector = "pkg.module:ConnectorClass"   # the class, module:qualname
    scenario = "test_silent_peer_caught_by_deadline"
    policy = "fail"
    layout = "tp1"
    findings = [
      { clauses = ["C2", "C10"], check = "liveness", stage = "scenario" },
    ]
    reason = "what breaks, in a sentence"       # optional

An entry of the older form (``clauses = [...]`` and no ``findings``) matched any finding of
its clauses; it is refused with the file and entry named. ``--kvfail-write-baseline FILE``
writes a file of the current form from a run.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Baseline",
    "BaselineError",
    "Entry",
    "Fingerprint",
    "clauses_of",
    "fingerprint",
    "render_baseline",
]

#: A clause citation in a finding: ``C10``, ``C2/C10``.
_CITATION = re.compile(r"\bC\d+(?:/C\d+)*\b")
_KEYS = ("connector", "scenario", "policy", "layout")
#: The stage of a finding made in the scenario's own run (no prefix names another).
MAIN_STAGE = "scenario"


class BaselineError(ValueError):
    """The baseline file cannot be used (message says where and why)."""


def clauses_of(violation: str) -> frozenset[str]:
    """The clauses one violation cites first (``"C2/C10 liveness: ..."`` -> C2, C10); empty
    when it cites none, which no baseline entry can absorb."""
    found = _CITATION.search(violation)
    return frozenset(found.group(0).split("/")) if found else frozenset()


def _clause_order(clause: str) -> int:
    return int(clause.lstrip("C") or 0)


def _words(text: str) -> str:
    """``text`` without parenthesised or bracketed asides (counts, issue numbers) and
    colons, with single spaces: what stays the same from run to run."""
    text = re.sub(r"\([^)]*\)|\[|\]", " ", text)
    return " ".join(text.replace(":", " ").split())


@dataclass(frozen=True, order=True)
class Fingerprint:
    """What a finding is, without the run's particulars (ids, counts, timings)."""

    clauses: tuple[str, ...]
    #: The check that found it: the words between the citation and the first colon
    #: (``liveness``, ``leak``, ``wrong KV``, ``policy/fail``; empty for a clause's only one).
    check: str
    #: Where in the scenario: ``scenario``, or the phase a prefix names (``warm-up load``,
    #: a sub-story such as ``abort-then-success``).
    stage: str = MAIN_STAGE

    def describe(self) -> str:
        check = f" {self.check}" if self.check else ""
        return f"{'/'.join(self.clauses)}{check} @ {self.stage}"

    def as_toml(self) -> str:
        clauses = ", ".join(_toml_str(c) for c in self.clauses)
        return (
            f"{{ clauses = [{clauses}], check = {_toml_str(self.check)}, "
            f"stage = {_toml_str(self.stage)} }}"
        )


def fingerprint(violation: str) -> Fingerprint | None:
    """The fingerprint of one finding (``"C2/C10 liveness: r-7 still waiting"`` -> C2/C10,
    ``liveness``, ``scenario``); None when it cites no clause."""
    found = _CITATION.search(violation)
    if found is None:
        return None
    clauses = tuple(sorted(set(found.group(0).split("/")), key=_clause_order))
    head, colon, _ = violation[found.end() :].partition(":")
    check = _words(head) if colon else ""
    stage = _words(violation[: found.start()]) or MAIN_STAGE
    return Fingerprint(clauses, check, stage)


@dataclass
class Entry:
    """One accepted failure, pinned to its findings' fingerprints."""

    connector: str
    scenario: str
    policy: str
    layout: str
    findings: frozenset[Fingerprint]
    reason: str = ""
    #: Set during the run: the entry's scenario ran and failed as the entry says.
    matched: bool = False
    #: Set during the run: why the entry no longer holds (its scenario passed or skipped).
    stale: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.connector, self.scenario, self.policy, self.layout)

    @property
    def clauses(self) -> frozenset[str]:
        return frozenset(c for f in self.findings for c in f.clauses)

    def absorbs(self, violations: Iterable[str]) -> list[str]:
        """The violations this entry does NOT cover (empty: it absorbs all of them)."""
        return [v for v in violations if fingerprint(v) not in self.findings]

    def describe(self) -> str:
        return f"{self.connector} {self.scenario} [{self.policy}, {self.layout}]"

    def expects(self) -> str:
        return "; ".join(f.describe() for f in sorted(self.findings))


def _fingerprints(raw: Any, where: str) -> frozenset[Fingerprint]:
    if not isinstance(raw, list) or not raw:
        raise BaselineError(f"{where}: findings must be a non-empty array of tables")
    out = set()
    for n, item in enumerate(raw, 1):
        clauses = item.get("clauses") if isinstance(item, dict) else None
        if (
            not isinstance(clauses, list)
            or not clauses
            or not all(isinstance(c, str) and re.fullmatch(r"C\d+", c) for c in clauses)
            or not isinstance(item.get("check", ""), str)
            or not isinstance(item.get("stage", MAIN_STAGE), str)
        ):
            raise BaselineError(
                f"{where}, finding {n}: expected {{ clauses = ['C1', ...], check = '...', "
                f"stage = '...' }}"
            )
        out.add(
            Fingerprint(
                tuple(sorted(set(clauses), key=_clause_order)),
                str(item.get("check", "")),
                str(item.get("stage", MAIN_STAGE)),
            )
        )
    return frozenset(out)


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
            missing = [k for k in _KEYS if k not in raw]
            if missing:
                raise BaselineError(f"{where}: missing {', '.join(missing)}")
            if ":" not in str(raw["connector"]):
                raise BaselineError(
                    f"{where}: connector must be the exact class, module:qualname "
                    f"(got {raw['connector']!r})"
                )
            named = f"{where} ({raw['scenario']} [{raw['policy']}, {raw['layout']}])"
            if "findings" not in raw:
                if "clauses" in raw:
                    raise BaselineError(
                        f"{named}: a clause-only entry (clauses = {raw['clauses']!r}) would "
                        "absorb any finding of those clauses, and is no longer accepted; list "
                        "its findings' fingerprints instead, e.g. findings = [{ clauses = "
                        "['C2', 'C10'], check = 'liveness', stage = 'scenario' }], or rewrite "
                        "the file from a run with --kvfail-write-baseline"
                    )
                raise BaselineError(f"{named}: missing findings")
            entry = Entry(
                connector=str(raw["connector"]),
                scenario=str(raw["scenario"]),
                policy=str(raw["policy"]),
                layout=str(raw["layout"]),
                findings=_fingerprints(raw["findings"], named),
                reason=str(raw.get("reason", "")),
            )
            if entry.key in out.entries:
                raise BaselineError(f"{where}: duplicates an earlier entry ({entry.describe()})")
            out.entries[entry.key] = entry
        return out

    def lookup(self, connector: str, scenario: str, policy: str, layout: str) -> Entry | None:
        return self.entries.get((connector, scenario, policy, layout))


def entry_for(
    connector: str, scenario: str, policy: str, layout: str, violations: list[str]
) -> Entry | None:
    """The entry that absorbs exactly ``violations``; None when one of them cites no
    clause (an error, not a known violation)."""
    prints = [fingerprint(v) for v in violations]
    if not prints or any(p is None for p in prints):
        return None
    return Entry(
        connector=connector,
        scenario=scenario,
        policy=policy,
        layout=layout,
        findings=frozenset(p for p in prints if p is not None),
        reason=violations[0][:300],
    )


def render_baseline(entries: Iterable[Entry], *, header: Iterable[str] = ()) -> str:
    """TOML text for ``entries`` (what ``--kvfail-write-baseline`` writes)."""
    lines = [
        *(f"# {line}" if line else "#" for line in header),
        "# kvfail conformance baseline: known findings, each pinned to its fingerprint",
        "# (clauses, check, stage). Pass it with --kvfail-baseline; an entry that no longer",
        "# fails, or whose scenario skips, fails the run.",
    ]
    for e in sorted(entries, key=lambda e: e.key):
        lines += [
            "",
            "[[known]]",
            f"connector = {_toml_str(e.connector)}",
            f"scenario = {_toml_str(e.scenario)}",
            f"policy = {_toml_str(e.policy)}",
            f"layout = {_toml_str(e.layout)}",
            "findings = [",
            *(f"  {f.as_toml()}," for f in sorted(e.findings)),
            "]",
        ]
        if e.reason:
            lines.append(f"reason = {_toml_str(e.reason)}")
    return "\n".join(lines) + "\n"


def _toml_str(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{escaped}"'
