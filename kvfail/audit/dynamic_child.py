"""The audit's dynamic tier, child side: the conformance suite run connector by
connector in one pytest run (on :func:`workers` xdist workers where xdist is installed),
its progress reported to the audit as it goes.

Why a process of its own (:class:`kvfail.audit.dynamic.ConformanceRunner` starts it as
``python -m kvfail.audit.dynamic_child``): vLLM, the transports and the peers stay out of
the audit process, one vLLM import per process serves every connector, and a connector
that wedges cannot hang the audit. This module keeps the connectors a transport driver
can run, orders and paces the suite's items, and writes ``plan.json``,
``collected.json``, ``progress.jsonl`` and ``budget.json`` beside the suite's own report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvfail.conformance.scenarios import DIRECTORY

__all__ = [
    "GUARD_CLAUSE",
    "GUARD_PREFIX",
    "PROGRESS",
    "SCENARIOS",
    "audit_plugin",
    "main",
    "scenario_modules",
    "suite_args",
]

SCENARIOS = DIRECTORY / "test_scenarios.py"


def scenario_modules() -> list[Path]:
    """Every scenario module of the suite, :data:`SCENARIOS` first: the audit judges a
    connector on the whole suite (store faults, concurrency, quarantine), and a module
    added to the package is run without anyone listing it here. A driver that lacks a
    module's optional capability skips its scenarios, naming it."""
    rest = sorted(p for p in DIRECTORY.glob("test_*.py") if p != SCENARIOS)
    return [SCENARIOS, *rest] if SCENARIOS.exists() else rest


#: The most pytest-xdist workers the child runs the suite on by default, ``--dist
#: loadgroup``: each row's scenarios carry one ``xdist_group``
#: (:mod:`kvfail.conformance.hooks.distributed`), so a row stays on one worker with its
#: peers while other workers run other rows. Most of a scenario's time is spent waiting
#: on a peer, a fault or a deadline, so one row more than the machine has cores uses the
#: CPU time the others leave idle; the suite stretches its verdict-deciding waits by the
#: contention it measures, so the extra row costs time, never a verdict. Every worker
#: holds its own vLLM and peers, hence the cap. Serial where xdist is not installed (a
#: test extra) or the machine has one core.
MAX_WORKERS = 4
#: Hands the audit plugin's settings to xdist's workers (a plugin object given to
#: ``pytest.main`` stays in the process that made it; workers inherit the environment).
PLUGIN_ENV = "KVFAIL_AUDIT_CHILD"

#: Child lines in ``progress.jsonl`` (the parent polls it; pytest's own output goes to
#: ``child.log``, whose tail is kept for errors).
PROGRESS = "progress.jsonl"

#: The ``--connector`` prefix that runs a driver with D wrapped by kvfail's guard
#: (``kvfail.conformance.guard_driver.GUARD_PREFIX``, not imported: it loads the drivers).
GUARD_PREFIX = "guard:"
#: A ``Guard(X)`` row runs only the scenarios citing this clause (a deadline: the
#: deadline and stranding scenarios, what the guard adds): the full set for every row
#: twice would not fit the default budget. Its row note says so.
GUARD_CLAUSE = "C10"
#: The soak's batches in the audit (``--kvfail-soak-batches``): the first third of the
#: suite's plan. The matrix shows whether a row survives a long mixed run at all; a bug
#: that needs every batch to show is the full suite's to find, not the budget's.
SOAK_BATCHES = 5


class _AuditPlugin:
    """In the child: run connector by connector, report progress, honour the budget."""

    def __init__(
        self,
        run: list[str],
        report: Path,
        stop_at: float | None,
        worker: str | None = None,
    ) -> None:
        self.order = {spec: i for i, spec in enumerate(run)}
        #: The xdist worker this plugin runs in (None: serial), from pytest's own config:
        #: ``PYTEST_XDIST_WORKER`` is also set in a child of an xdist worker, which is not one.
        self.worker = worker
        self.report = report
        self.stop_at = stop_at
        #: Each item's place in the run, by ``id(item)``: ``--dist loadgroup`` renames
        #: items (``@group``) after this plugin has seen them, and their hash with them.
        self.index: dict[int, int] = {}
        self.total = 0
        self._progress = (report / PROGRESS).open("a", encoding="utf-8", buffering=1)

    def emit(self, **event: Any) -> None:
        self._progress.write(json.dumps(event) + "\n")

    @staticmethod
    def _params(item: Any) -> tuple[str, str, str] | None:
        """(connector, policy, layout) of a suite item, None for any other item."""
        callspec = getattr(item, "callspec", None)
        if callspec is None or "kvfail_connector" not in callspec.params:
            return None
        layout = callspec.params.get("kvfail_layout")
        return (
            str(callspec.params["kvfail_connector"]),
            str(callspec.params["kvfail_policy"]),
            str(getattr(layout, "name", layout or "tp1")),
        )

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        # Connector-major: pytest's order (scenario by scenario) would start every
        # connector's peers at once and let a budget cut a bit of every row.
        def key(pair: tuple[int, Any]) -> tuple[int, int]:
            params = self._params(pair[1])
            rank = -1 if params is None else self.order.get(params[0], len(self.order))
            return rank, pair[0]

        items[:] = [item for _i, item in sorted(enumerate(items), key=key)]
        skipped = [item for item in items if not self._runs(item)]
        if skipped:
            items[:] = [item for item in items if self._runs(item)]
            config.hook.pytest_deselected(items=skipped)
        collected = []
        for item in items:
            params = self._params(item)
            if params is None:
                continue
            self.index[id(item)] = len(collected) + 1
            collected.append(
                {
                    "connector": params[0],
                    "policy": params[1],
                    "layout": params[2],
                    "scenario": getattr(item, "originalname", item.name),
                    "nodeid": item.nodeid,
                }
            )
        self.total = len(collected)
        # Every xdist worker collects the same items: each writes the same file, and one
        # tells the audit (the first, or the only process when serial).
        _write_atomic(self.report / "collected.json", json.dumps(collected))
        if self.worker in (None, "gw0"):
            self.emit(event="collected", n=self.total, connectors=len(self.order))

    def _runs(self, item: Any) -> bool:
        """Whether the audit runs this item: a guard row's only when it cites
        :data:`GUARD_CLAUSE`."""
        params = self._params(item)
        if params is None or not params[0].startswith(GUARD_PREFIX):
            return True
        marker = item.get_closest_marker("clauses")
        return marker is not None and GUARD_CLAUSE in marker.args

    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> bool | None:
        params = self._params(item)
        if params is None:
            return None
        if self.stop_at is not None and time.monotonic() >= self.stop_at:
            i = self.index.get(id(item), 1)
            reason = "not run (budget): not started within the audit's --budget-s"
            _write_atomic(self.report / "budget.json", json.dumps({"reason": reason}))
            if self.worker is not None:  # the other worker's items: no count
                self.emit(event="budget")
            else:
                self.emit(event="budget", not_run=self.total - i + 1)
            item.session.shouldstop = "kvfail audit: budget spent"
            return True  # not run; pytest stops after this item
        self.emit(
            event="start",
            i=self.index.get(id(item), 0),
            connector=params[0],
            policy=params[1],
            layout=params[2],
            scenario=getattr(item, "originalname", item.name),
        )
        return None


def audit_plugin(
    run: list[str], report: Path, stop_at: float | None, worker: str | None = None
) -> _AuditPlugin:
    """The child's pytest plugin (``stop_at``: ``time.monotonic()`` after which no scenario
    starts; None: no budget). It only orders, paces and reports progress: the records are
    the conformance plugin's ``records.jsonl`` and ``report.json`` in ``report``, and the
    conformance plugin stops each connector's driver after its last scenario."""
    import pytest

    # Before pytest's runner, which would run the item (this module imports no pytest).
    pytest.hookimpl(tryfirst=True)(_AuditPlugin.pytest_runtest_protocol)
    return _AuditPlugin(run, report, stop_at, worker)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (two workers may write it; the audit reads it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def workers(requested: int | None = None) -> int:
    """How many xdist workers the child uses (0: serial, in the child process itself):
    ``requested`` (``kvfail audit --workers``), else the machine's cores + 1, at most
    :data:`MAX_WORKERS`."""
    cores = os.cpu_count() or 1
    if importlib.util.find_spec("xdist") is None or (requested is None and cores < 2):
        return 0
    return min(cores + 1, MAX_WORKERS) if requested is None else requested


def pytest_configure(config: Any) -> None:
    """In an xdist worker (this module loaded with ``-p``): register the audit plugin from
    :data:`PLUGIN_ENV`. ``stop_at`` is ``time.monotonic()``, one clock for every process
    of the machine."""
    settings = os.environ.get(PLUGIN_ENV)
    if not settings or not hasattr(config, "workerinput"):
        return
    got = json.loads(settings)
    worker = str(config.workerinput.get("workerid", "gw0"))
    plugin = audit_plugin(list(got["run"]), Path(got["report"]), got["stop_at"], worker)
    config.pluginmanager.register(plugin, "kvfail-audit-child")


def suite_args(run: list[str], report: Path, policy: str, layouts: list[str]) -> list[str]:
    """The child's pytest arguments: every scenario module, for the connectors in ``run``."""
    return [
        *(str(p) for p in scenario_modules()),
        "-q",
        "-p",
        "no:cacheprovider",
        "--kvfail-report",
        str(report),
        # A transport absent here is a "not applicable" cell in the audit, not a failure
        # (the project's own test run requires every driver).
        "-o",
        "kvfail_require_drivers=false",
        "--policy",
        policy,
        "--kvfail-soak-batches",
        str(SOAK_BATCHES),
        *(a for layout in layouts for a in ("--layout", layout)),
        *(a for spec in run for a in ("--connector", spec)),
    ]


def main(argv: list[str] | None = None) -> int:
    """Child process: keep the connectors a transport driver can run, then run the suite."""
    ap = argparse.ArgumentParser(prog="python -m kvfail.audit.dynamic_child")
    ap.add_argument("--report", required=True, type=Path)
    ap.add_argument("--policy", choices=("fail", "recompute", "both"), default="fail")
    ap.add_argument("--layout", action="append", default=[], help="passed to the suite")
    ap.add_argument("--workers", type=int, default=None, help="xdist workers (0: serial)")
    ap.add_argument(
        "--stop-after",
        type=float,
        default=0.0,
        help="start no scenario after this many seconds (0: no limit)",
    )
    ap.add_argument("specs", nargs="*")
    args = ap.parse_args(argv)
    stop_at = time.monotonic() + args.stop_after if args.stop_after > 0 else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kvfail.rig.processes import close_peers_on_sigterm

    close_peers_on_sigterm()  # the budget's SIGTERM: pytest tears down and closes the peers
    from kvfail.conformance.driver import DriverUnavailable
    from kvfail.conformance.generic_driver import GenericDriver
    from kvfail.conformance.resolve import resolve

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
        if isinstance(getattr(driver, "inner", driver), GenericDriver):  # guard: its inner's
            not_run[spec] = "no transport driver (register one in 'kvfail.drivers')"
            continue
        cls = _connector_class(spec)
        if cls is not None and cls in seen:
            alias[spec] = seen[cls]
            continue
        if cls is not None:
            seen[cls] = spec
        run.append(spec)
    # The audit's order is kept (kvfail.audit.dynamic.run_order): grouping by driver kind
    # put both Mooncake connectors after the NIXL ones, where the budget cut them. Drivers
    # of one kind on one worker still share a P: a driver hands its P to the next of its
    # kind, and it is closed after the last one.
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "plan.json").write_text(
        json.dumps({"run": run, "not_run": not_run, "alias": alias})
    )
    if not run:
        (args.report / "report.json").write_text("[]")
        return 0
    import pytest

    pytest_args = suite_args(run, args.report, args.policy, args.layout)
    n = min(workers(args.workers), len(run))  # a worker without a row only costs its start
    if n:
        os.environ[PLUGIN_ENV] = json.dumps(
            {"run": run, "report": str(args.report), "stop_at": stop_at}
        )
        pytest_args += ["-p", "kvfail.audit.dynamic_child", "-n", str(n)]
        # Rows start in the audit's order (kvfail.audit.dynamic.run_order): xdist would
        # start the rows with the most scenarios first, every guard row after them all.
        pytest_args += ["--dist", "loadgroup", "--no-loadscope-reorder"]
        plugins: list[Any] = []  # the controller runs no scenario: the workers pace them
    else:
        plugins = [audit_plugin(run, args.report, stop_at)]
    rc = pytest.main(pytest_args, plugins=plugins)
    # 0/1: ran (failures are findings); 2: interrupted (budget or SIGTERM, report kept).
    return 0 if rc in (0, 1, 2) else int(rc)


def _connector_class(spec: str) -> object | None:
    """The class a spec names, to run registry aliases of one class only once (a guard
    spec: the pair ("guard", its inner's class))."""
    if spec.startswith(GUARD_PREFIX):
        inner = _connector_class(spec.removeprefix(GUARD_PREFIX))
        return None if inner is None else (GUARD_PREFIX, inner)
    from kvfail.conformance.claims import connector_class

    try:
        if spec.startswith("vllm:"):
            return connector_class(spec.removeprefix("vllm:"), None)
        if ":" in spec:
            module, _, name = spec.partition(":")
            return connector_class(name, module)
    except Exception:
        return None
    return None


if __name__ == "__main__":
    sys.exit(main())
