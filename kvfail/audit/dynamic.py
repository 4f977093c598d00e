"""The audit's dynamic tier: the conformance suite itself, run once for every connector
that a real transport driver can drive.

Why this shape: a second implementation of the suite would drift from it, so the tier is
literally ``pytest kvfail/conformance/scenarios/test_*.py --connector A --connector B ...
--kvfail-report DIR`` (every scenario module, :func:`~kvfail.audit.dynamic_child.
scenario_modules`) in ONE child run (one vLLM import per process, not per connector; vLLM,
transports and peers stay out of the audit process, and a connector that wedges cannot
hang the audit). Connectors without a transport driver are not run: a suite with no peer
proves little, and
constructing some of them blocks forever on services that are absent here (LMCache).
Their row says so. This module is the parent: it starts the child
(:mod:`kvfail.audit.dynamic_child`), relays its progress, stops it and every peer it
started at the budget (:mod:`kvfail.rig.process_tree`), and reads its records as findings.

Time (the whole audit must end within its budget, on a small CPU machine too):

* one policy (``fail``) and one layout (``tp1``) by default: what a connector reports
  does not depend on the policy; ``--policy both`` / ``--layout all`` run more;
* the child runs the scenarios connector by connector (not scenario by scenario), so a
  connector's peers start when it begins and stop after its last scenario, and the
  budget cuts whole tails; with pytest-xdist, several rows at a time
  (:func:`~kvfail.audit.dynamic_child.workers`, ``--workers``);
* a wall-clock budget for the whole audit (``--budget-s``): the child starts no scenario
  in the last :data:`RESERVE_S` seconds, and the scenarios it did not reach are reported
  as ``not run (budget)``, never as results; near the budget's end the child is stopped
  (SIGTERM, so pytest tears its peers down and writes the report, then SIGKILL to the
  child's process group and to every peer it started, which live in their own groups).

Every cell comes from a scenario that ran in the child (its ``report.json``, or the
``records.jsonl`` it appends as each scenario ends when it was killed before the end).
The rig patches the child applied to the system under test come from the same files
(``rig_patches.json``, or each record's ``rig_patches``), so the audit names them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfail.audit.callgraph import Evidence
from kvfail.audit.dynamic_child import GUARD_CLAUSE, GUARD_PREFIX, PROGRESS, SCENARIOS
from kvfail.audit.inventory import Target
from kvfail.audit.static import FAIL, NA, PASS, UNKNOWN, CheckSpec, Finding
from kvfail.conformance.report import RECORDS_FILE
from kvfail.conformance.scenarios import DIRECTORY
from kvfail.rig.process_tree import reap, stop_tree
from kvfail.rig.procfs import descendants

#: Outcome of one scenario over all policies: the worst one wins. A harness error (the
#: installed vLLM lacks a feature the tool needs) outranks a pass, never a verdict of failure.
_RANK = {"failed": 4, "xfailed": 4, "error": 3, "skipped": 1, "passed": 2}
#: Default wall-clock budget of the whole audit (static + dynamic), seconds.
DEFAULT_BUDGET_S = 480.0
#: The child starts no scenario in the budget's last RESERVE_S seconds: a scenario (one
#: that starts or restarts P takes the longest) and the peers' teardown should still fit
#: before the stop below.
RESERVE_S = 50.0
#: After SIGTERM (pytest tears the peers down and writes the report), seconds before SIGKILL.
TERM_GRACE_S = 10.0
#: The budget's last seconds, left for making sure every killed process is gone, reading
#: the report, printing the matrix and exiting, with room for a busy machine: the child
#: gets SIGTERM at budget - TERM_GRACE_S - FINISH_S.
FINISH_S = 20.0
#: With no budget (``--budget-s 0``) the child is still stopped after this long.
HARD_CAP_S = 3600.0
#: The child's records, one line per finished scenario (``report.json`` comes at the end).
RECORDS = RECORDS_FILE

Progress = Callable[[str], None]


GUARD_NOTE = (
    f"guard row: only the scenarios citing {GUARD_CLAUSE} (deadline and stranding) run, "
    "to keep the audit within its budget"
)


def conformance_spec(target: Target) -> str:
    """The ``--connector`` value that names this target to the conformance suite."""
    if target.guarded is not None:
        return GUARD_PREFIX + conformance_spec(target.guarded)
    if target.origin == "vllm-registry":
        return f"vllm:{target.name}"
    return target.spec


def run_order(specs: list[str]) -> list[str]:
    """The order the child starts rows in: each row, then its guard row, in the matrix's
    order otherwise.

    Why: a guard row costs about what its inner's row costs (the same transport, the same
    faults), and the costliest pair ends the run. Run after every unguarded row, a guard
    row of a slow transport started last and ran alone; beside its inner, the workers
    share the slow pair. A budget too small for every row cuts the last rows, kvfail's
    own among them, before any upstream row or the guard's verdict on it."""
    guards = {s.removeprefix(GUARD_PREFIX): s for s in specs if s.startswith(GUARD_PREFIX)}
    order: list[str] = []
    for spec in specs:
        if spec.startswith(GUARD_PREFIX):
            continue
        order.append(spec)
        if spec in guards:
            order.append(guards.pop(spec))
    return order + list(guards.values())  # a guard row whose inner is not run here


class ConformanceRunner:
    """A ``DynamicRunner`` that runs the suite once (``prepare``) and answers per target.

    ``budget_s`` is the wall-clock budget of the whole audit, counted from ``start``
    (default: when the runner is made, i.e. when the audit starts); ``None`` or ``0``: no
    budget (the child is still stopped after :data:`HARD_CAP_S`).
    """

    def __init__(
        self,
        budget_s: float | None = DEFAULT_BUDGET_S,
        python: str = sys.executable,
        policy: str = "fail",
        start: float | None = None,
        layouts: list[str] | None = None,
        workers: int | None = None,
    ) -> None:
        self.budget_s = budget_s if budget_s and budget_s > 0 else None
        self.policy = policy
        #: ``--layout`` values for the suite (None: the suite's own default list).
        self.layouts = layouts
        #: xdist workers of the child (None: its default for this machine; 0: serial).
        self.workers = workers
        self.python = python
        self.start = time.monotonic() if start is None else start
        self._records: dict[str, list[dict[str, Any]]] = defaultdict(list)
        #: Scenarios the child collected, per connector spec: scenario -> its variants
        #: ("policy layout", one per pytest item).
        self._collected: dict[str, dict[str, set[str]]] = defaultdict(dict)
        self._not_run: dict[str, str] = {}
        #: Registry aliases of one class (NixlConnector is NixlPullConnector) run once.
        self._alias: dict[str, str] = {}
        #: Why scenarios the child collected have no record (budget, stopped, crashed).
        self._cut: str | None = None
        self.leftovers: list[str] = []
        self.error: str | None = None
        #: The rig patches the child applied (``kvfail.rig.patches.summarize`` entries);
        #: None until a report of the child's was read.
        self.rig_patches: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ parent side

    def prepare(self, targets: list[Target], progress: Progress | None = None) -> None:
        if not SCENARIOS.exists():
            self.error = f"conformance scenarios not found at {SCENARIOS} (a source checkout)"
            return
        specs = run_order([conformance_spec(t) for t in targets if t.installed])
        now = time.monotonic()
        if self.budget_s is None:
            stop_after, kill_at = 0.0, now + HARD_CAP_S
        else:
            left = self.budget_s - (now - self.start)
            stop_after = max(left - RESERVE_S, 0.001)
            kill_at = self.start + self.budget_s - TERM_GRACE_S - FINISH_S
        with tempfile.TemporaryDirectory(prefix="kvfail-audit-") as tmp:
            cmd = [
                self.python,
                "-m",
                "kvfail.audit.dynamic_child",
                "--report",
                tmp,
                "--policy",
                self.policy,
                "--stop-after",
                f"{stop_after:.3f}",
                *(a for layout in self.layouts or [] for a in ("--layout", layout)),
                *(["--workers", str(self.workers)] if self.workers is not None else []),
                *specs,
            ]
            tail = self._run_child(cmd, Path(tmp), kill_at, progress or (lambda _text: None))
            self._read(Path(tmp), tail)

    def _read(self, tmp: Path, tail: str) -> None:
        plan = tmp / "plan.json"
        if plan.exists():
            planned = json.loads(plan.read_text())
            self._not_run = planned["not_run"]
            self._alias = planned.get("alias", {})
        collected = tmp / "collected.json"
        if collected.exists():
            for item in json.loads(collected.read_text()):
                by = self._collected[str(item["connector"])]
                by.setdefault(str(item["scenario"]), set()).add(_variant(item))
        cut = tmp / "budget.json"
        if cut.exists():  # the child stopped starting scenarios: the budget, not a crash
            self._cut = str(json.loads(cut.read_text())["reason"])
        elif self.error is not None:
            self._cut = f"not run ({'budget' if self.budget_s else 'stopped'}): {self.error}"
        report, lines = tmp / "report.json", tmp / RECORDS
        if report.exists():
            records = json.loads(report.read_text())
        elif lines.exists():  # stopped before the session's end: what finished
            records = []
            for line in lines.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut by SIGKILL
                    records.append(json.loads(line))
        else:
            if self._cut is None or self.error is not None:  # no scenario ran: not an error
                self.error = self.error or f"conformance run wrote no report: {tail[-400:]}"
            return
        for rec in records:
            self._records[str(rec["connector"])].append(rec)
        self.rig_patches = _read_patches(tmp / "rig_patches.json", self._records)

    def incomplete(self) -> str | None:
        """One line when some collected scenarios have no result (budget, stop), else None."""
        done = {(c, str(r["scenario"]), _variant(r)) for c, rs in self._records.items() for r in rs}
        todo = {(c, s, v) for c, by in self._collected.items() for s, vs in by.items() for v in vs}
        missing = len(todo - done)
        if not missing:
            return None
        return f"{missing} of {len(todo)} scenario runs {self._cut or 'not run'}"

    def _run_child(self, cmd: list[str], tmp: Path, kill_at: float, progress: Progress) -> str:
        """Run the suite, relaying its progress; past ``kill_at`` (or on Ctrl-C), stop it
        and every process it started. Returns the tail of its output."""
        log = tmp / "child.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Where the kvfail package lives (the checkout's root, or site-packages):
                # ``python -m`` puts it first on the child's path, so the checkout's
                # ``connectors`` and ``tests`` import as they do here.
                cwd=DIRECTORY.parents[2],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # Its own group (SIGKILL reaches it, never us), our session: see
                # kvfail.rig.processes.
                process_group=0,
            )
        tracked: dict[int, str] = {}
        relay = _Relay(tmp / PROGRESS, progress, self.start, self.budget_s)
        try:
            while proc.poll() is None:
                tracked.update(descendants(proc.pid))
                relay.poll()
                if time.monotonic() >= kill_at:
                    limit = f"--budget-s {self.budget_s:g}" if self.budget_s else "its hard cap"
                    self.error = (
                        f"the conformance run was stopped at {limit} (a scenario still "
                        "running; the results of those that finished are kept)"
                    )
                    tracked.update(stop_tree(proc, tracked, TERM_GRACE_S))
                    break
                time.sleep(0.5)
        except BaseException:  # Ctrl-C on the audit: never leave the child or a peer
            tracked.update(stop_tree(proc, tracked, TERM_GRACE_S))
            raise
        finally:
            relay.poll()
        self.leftovers = reap(tracked)
        return log.read_text(errors="replace")[-4000:] if log.exists() else ""

    def __call__(self, target: Target) -> list[Finding]:
        spec = conformance_spec(target)
        spec = self._alias.get(spec, spec)
        if self.error is not None and not self._records and not self._collected:
            raise RuntimeError(self.error)
        if spec in self._not_run:
            target.notes.append(f"dynamic tier not run: {self._not_run[spec]}")
            return []
        if target.guarded is not None:
            target.notes.append(GUARD_NOTE)
        if self.error is not None:
            target.notes.append(f"dynamic tier: {self.error}")
        if self.leftovers:
            target.notes.append(
                f"dynamic tier: killed {len(self.leftovers)} process(es) the run left behind"
            )
        by_scenario: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for rec in self._records.get(spec, []):
            by_scenario[str(rec["scenario"])].append(rec)
        collected = self._collected.get(spec, {})
        why = self._cut or "not run: the conformance run ended before it"
        found: list[Finding] = []
        cut = 0
        for name in sorted(set(collected) | set(by_scenario)):
            recs = by_scenario.get(name, [])
            missing = sorted(collected.get(name, set()) - {_variant(r) for r in recs})
            cut += len(missing)
            found.append(_finding(name, recs, missing, why) if recs else _not_run(name, why))
        if by_scenario:
            recs = [r for rs in by_scenario.values() for r in rs]
            seconds = sum(float(r.get("duration_s", 0.0)) for r in recs)
            variants = ", ".join(sorted({_variant(r) for r in recs}))
            target.notes.append(
                f"dynamic tier: {len(recs)} scenario runs ({len(by_scenario)} scenarios; "
                f"{variants}) in {seconds:.1f} s"
            )
        patched = sorted({str(n) for rs in by_scenario.values() for r in rs for n in _patches(r)})
        if patched:
            target.notes.append(
                f"dynamic tier ran under rig patches: {', '.join(patched)} (docs/rig-patches.md)"
            )
        if cut:
            total = sum(len(v) for v in collected.values())
            short = "budget; rerun with a larger --budget-s" if "budget" in why else why
            target.notes.append(f"dynamic tier: {cut} of {total} scenario runs not run ({short})")
        return found


class _Relay:
    """Turns the child's ``progress.jsonl`` lines into progress text as they appear."""

    def __init__(self, path: Path, progress: Progress, start: float, budget: float | None):
        self.path, self.progress, self.start, self.budget = path, progress, start, budget
        self.offset = 0
        self.total = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        for raw in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                self._show(json.loads(raw))

    def _show(self, ev: dict[str, Any]) -> None:
        spent = time.monotonic() - self.start
        clock = f"{spent:.0f} s" + ("" if self.budget is None else f" of {self.budget:.0f}")
        if ev.get("event") == "collected":
            self.total = int(ev["n"])
            self.progress(f"dynamic tier: {self.total} scenarios over {ev['connectors']} ({clock})")
        elif ev.get("event") == "start":
            self.progress(
                f"dynamic tier {ev['i']}/{self.total} ({clock}): {ev['connector']} "
                f"{ev['scenario']}[{ev['policy']} {ev.get('layout', 'tp1')}]"
            )
        elif ev.get("event") == "budget":  # from each xdist worker, without a count
            left = f"{ev['not_run']} not run" if "not_run" in ev else "no more scenarios start"
            self.progress(f"dynamic tier: budget spent, {left} ({clock})")


def _patches(rec: dict[str, Any]) -> list[str]:
    return [str(n) for n in rec.get("rig_patches") or []]


def _read_patches(path: Path, records: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The child's ``rig_patches.json``; when it was stopped before writing one, the
    patches its records name, described from the catalogue (no counts)."""
    if path.exists():
        with contextlib.suppress(ValueError):
            loaded = json.loads(path.read_text())
            if isinstance(loaded, list):
                return [dict(p) for p in loaded]
    from kvfail.rig.patches import CATALOGUE

    by_name: dict[str, set[str]] = defaultdict(set)
    for connector, recs in records.items():
        for rec in recs:
            for name in _patches(rec):
                by_name[name].add(connector)
    return [
        {**dataclasses.asdict(patch), "connectors": sorted(by_name[name])}
        for name, patch in CATALOGUE.items()
        if name in by_name
    ]


def _variant(rec: dict[str, Any]) -> str:
    """One pytest item of a scenario: its policy and engine layout (``fail tp1``)."""
    return f"{rec.get('policy', '?')} {rec.get('layout') or 'tp1'}"


def _finding(
    scenario: str, recs: list[dict[str, Any]], missing: list[str] | None = None, why: str = ""
) -> Finding:
    """One cell from the scenario's runs: the worst outcome wins; a run that did not
    happen (``missing`` variants, the budget) turns a pass into unknown, never into pass."""
    worst = max(recs, key=lambda r: _RANK.get(str(r["outcome"]), 0))
    outcome = str(worst["outcome"])
    clauses = [str(c) for c in worst.get("clauses", []) or []]
    guards = " ".join(str(g) for g in worst.get("guards", []) or [])
    # "error" (the tool could not judge) stays UNKNOWN: never a pass, never a verdict.
    status = {"passed": PASS, "failed": FAIL, "xfailed": FAIL, "skipped": NA}.get(outcome, UNKNOWN)
    runs = ", ".join(f"{_variant(r)}={r['outcome']}" for r in recs)
    reason = str(worst.get("reason") or "")
    summary = outcome if not reason else f"{outcome}: {reason}"
    if len(recs) > 1 or missing:
        summary = f"{summary} [{_variant(worst)}]"
    if missing:
        runs += ", " + ", ".join(f"{v}=not run" for v in missing)
        if status != FAIL:
            status = UNKNOWN
            summary = f"{why} ({', '.join(missing)}); ran: {summary}"
    spec = _spec(scenario, clauses[0] if clauses else "-", guards or "-")
    where = Evidence(path=str(worst.get("nodeid", scenario)), line=0, text=runs)
    return Finding(spec.id, status, summary, [where], tier="DYNAMIC", check_spec=spec)


def _not_run(scenario: str, why: str) -> Finding:
    """A collected scenario the child never reached: an explicit unknown, never a result."""
    spec = _spec(scenario, "-", "-")
    return Finding(spec.id, UNKNOWN, why, [], tier="DYNAMIC", check_spec=spec)


def _spec(scenario: str, clause: str, resembles: str) -> CheckSpec:
    return CheckSpec(
        id=f"dyn:{scenario}",
        title=scenario.removeprefix("test_").replace("_", " "),
        clause=clause,
        level="MUST",
        resembles=resembles,
    )
