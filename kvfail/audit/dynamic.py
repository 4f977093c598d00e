"""The audit's dynamic tier: the conformance suite itself, run once for every connector
that a real transport driver can drive.

Why this shape: the issue forbids a second implementation, so the tier is literally
``pytest conformance/test_scenarios.py --connector ... --kvfail-report DIR`` in a child
process (vLLM, transports and peers stay out of the audit process, and a connector that
wedges cannot hang the audit: the child has a wall-clock limit). Connectors without a
transport driver are not run: a suite with no peer proves little, and constructing some
of them blocks forever on services that are absent here (LMCache). Their row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from kvfail.audit.inventory import Target
from kvfail.audit.static import FAIL, NA, PASS, UNKNOWN, CheckSpec, Evidence, Finding

SCENARIOS = Path(__file__).resolve().parents[2] / "conformance" / "test_scenarios.py"
#: Outcome of one scenario over all policies: the worst one wins.
_RANK = {"failed": 3, "xfailed": 3, "skipped": 1, "passed": 2}


def conformance_spec(target: Target) -> str:
    """The ``--connector`` value that names this target to the conformance suite."""
    if target.origin == "vllm-registry":
        return f"vllm:{target.name}"
    return target.spec


class ConformanceRunner:
    """A ``DynamicRunner`` that runs the suite once (``prepare``) and answers per target."""

    def __init__(
        self, timeout_s: float = 900.0, python: str = sys.executable, policy: str = "fail"
    ) -> None:
        self.timeout_s = timeout_s
        self.policy = policy
        self.python = python
        self._records: dict[str, list[dict[str, object]]] = defaultdict(list)
        self._not_run: dict[str, str] = {}
        #: Registry aliases of one class (NixlConnector is NixlPullConnector) run once.
        self._alias: dict[str, str] = {}
        self.error: str | None = None

    def prepare(self, targets: list[Target]) -> None:
        if not SCENARIOS.exists():
            self.error = f"conformance scenarios not found at {SCENARIOS} (a source checkout)"
            return
        specs = [conformance_spec(t) for t in targets if t.installed]
        with tempfile.TemporaryDirectory(prefix="kvfail-audit-") as tmp:
            cmd = [
                self.python,
                "-m",
                "kvfail.audit.dynamic",
                "--report",
                tmp,
                "--policy",
                self.policy,
                *specs,
            ]
            out = self._run_child(cmd)
            report = Path(tmp) / "report.json"
            plan = Path(tmp) / "plan.json"
            if plan.exists():
                planned = json.loads(plan.read_text())
                self._not_run = planned["not_run"]
                self._alias = planned.get("alias", {})
            if not report.exists():
                self.error = self.error or f"conformance run wrote no report: {out[-400:]}"
                return
            for rec in json.loads(report.read_text()):
                self._records[str(rec["connector"])].append(rec)

    def _run_child(self, cmd: list[str]) -> str:
        """Run the suite; past the limit, SIGTERM first so pytest tears down its peers
        (they live in their own process groups), then SIGKILL. Returns the output tail."""
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=SCENARIOS.parents[1],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            out, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.error = f"conformance run exceeded {self.timeout_s:.0f} s (partial results kept)"
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        return out or ""

    def __call__(self, target: Target) -> list[Finding]:
        spec = conformance_spec(target)
        spec = self._alias.get(spec, spec)
        if self.error is not None and not self._records:
            raise RuntimeError(self.error)
        if self.error is not None:
            target.notes.append(f"dynamic tier: {self.error}")
        if spec in self._not_run:
            target.notes.append(f"dynamic tier not run: {self._not_run[spec]}")
            return []
        by_scenario: dict[str, list[dict[str, object]]] = defaultdict(list)
        for rec in self._records.get(spec, []):
            by_scenario[str(rec["scenario"])].append(rec)
        return [_finding(name, recs) for name, recs in sorted(by_scenario.items())]


def _finding(scenario: str, recs: list[dict[str, object]]) -> Finding:
    worst = max(recs, key=lambda r: _RANK.get(str(r["outcome"]), 0))
    outcome = str(worst["outcome"])
    clauses = [str(c) for c in worst.get("clauses", []) or []]  # type: ignore[union-attr]
    guards = " ".join(str(g) for g in worst.get("guards", []) or [])  # type: ignore[union-attr]
    status = {"passed": PASS, "failed": FAIL, "xfailed": FAIL, "skipped": NA}.get(outcome, UNKNOWN)
    policies = ", ".join(f"{r['policy']}={r['outcome']}" for r in recs)
    reason = str(worst.get("reason") or "")
    summary = outcome if not reason else f"{outcome}: {reason}"
    spec = CheckSpec(
        id=f"dyn:{scenario}",
        title=scenario.removeprefix("test_").replace("_", " "),
        clause=clauses[0] if clauses else "-",
        level="MUST",
        resembles=guards or "-",
    )
    where = Evidence(path=str(worst.get("nodeid", scenario)), line=0, text=policies)
    return Finding(spec.id, status, summary, [where], tier="DYNAMIC", check_spec=spec)


def main(argv: list[str] | None = None) -> int:
    """Child process: keep the connectors a transport driver can run, then run the suite."""
    ap = argparse.ArgumentParser(prog="python -m kvfail.audit.dynamic")
    ap.add_argument("--report", required=True, type=Path)
    ap.add_argument("--policy", choices=("fail", "recompute", "both"), default="fail")
    ap.add_argument("specs", nargs="*")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvfail.conformance.driver import DriverUnavailable, GenericDriver, resolve

    run: list[str] = []
    not_run: dict[str, str] = {}
    alias: dict[str, str] = {}
    seen: dict[object, str] = {}
    for spec in args.specs:
        try:
            driver = resolve(spec)
        except DriverUnavailable as exc:
            not_run[spec] = str(exc)
            continue
        except Exception as exc:  # an import error in a connector's module
            not_run[spec] = f"{type(exc).__name__}: {exc}"
            continue
        if isinstance(driver, GenericDriver):
            not_run[spec] = "no transport driver (register one in 'kvfail.drivers')"
            continue
        cls = _connector_class(spec)
        if cls is not None and cls in seen:
            alias[spec] = seen[cls]
            continue
        if cls is not None:
            seen[cls] = spec
        run.append(spec)
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "plan.json").write_text(
        json.dumps({"run": run, "not_run": not_run, "alias": alias})
    )

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # pytest then tears down fixtures and closes the peers

    signal.signal(signal.SIGTERM, interrupted)
    if not run:
        (args.report / "report.json").write_text("[]")
        return 0
    import pytest

    connectors = [a for spec in run for a in ("--connector", spec)]
    rc = pytest.main(
        [
            str(SCENARIOS),
            "-q",
            "-p",
            "no:cacheprovider",
            "--kvfail-report",
            str(args.report),
            "--policy",
            args.policy,
            *connectors,
        ]
    )
    return 0 if rc in (0, 1) else int(rc)


def _connector_class(spec: str) -> object | None:
    """The class a spec names, to run registry aliases of one class only once."""
    try:
        if spec.startswith("vllm:"):
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            return KVConnectorFactory.get_connector_class_by_name(spec.removeprefix("vllm:"))
        if ":" in spec:
            import importlib

            module, _, name = spec.partition(":")
            return getattr(importlib.import_module(module), name)
    except Exception:
        return None
    return None


if __name__ == "__main__":
    sys.exit(main())
