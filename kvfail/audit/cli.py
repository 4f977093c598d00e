"""``kvfail audit``: command-line entry for the connector compliance matrix.

Wired into the ``kvfail`` command through :func:`add_parser` / :func:`run`; also runnable
as ``python -m kvfail.audit.cli``. The static tier never imports vLLM or a connector, so
``--quick`` stays in the low seconds. The dynamic tier is supplied by the conformance
suite through the ``dynamic_runner`` hook (same code as ``pytest conformance/``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

from kvfail.audit import add_command
from kvfail.audit.applicability import Assessor
from kvfail.audit.callgraph import Graph
from kvfail.audit.coverage import DRIVERS_PENDING, driven_refs, driver_entry_points, driver_for
from kvfail.audit.inventory import Target, UsageError, discover, guard_target
from kvfail.audit.report import RENDERERS, Audit, Row, columns_for, exit_status
from kvfail.audit.source import SourceIndex
from kvfail.audit.static import Finding, audit_target
from kvfail.conformance.layout import ALL_LAYOUTS  # light: no vLLM

# A dynamic runner gets one installed connector and returns its DYNAMIC findings (each with
# ``tier="DYNAMIC"`` and its own ``check_spec``), or raises to mark the tier failed for it.
DynamicRunner = Callable[[Target], list[Finding]]

#: A runner used instead of the default :class:`~kvfail.audit.dynamic.ConformanceRunner`.
DYNAMIC_RUNNER: DynamicRunner | None = None
#: ``kvfail.audit.dynamic.DEFAULT_BUDGET_S`` (not imported here: ``--quick`` stays light).
_DEFAULT_BUDGET_S = 480.0


def _layout(value: str) -> str:
    """A ``--layout`` value the suite accepts, checked here: the suite would only reject it
    in the dynamic tier's child, after the static tier has run."""
    from kvfail.conformance.layout import parse_layouts  # light: no vLLM

    try:
        parse_layouts([value])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _budget(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:  # also NaN, which every later comparison would treat as "no budget"
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected a number of seconds >= 0 (0: no budget)"
        )
    return seconds


def _workers(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected a whole number of workers >= 0 (0: serial)"
        )
    return n


def _one_line_errors(p: argparse.ArgumentParser) -> None:
    """Bad input is one line on stderr and exit 2 (argparse would print the usage too)."""
    parse_known_args = p.parse_known_args

    def error(message: str) -> NoReturn:
        p.exit(2, f"kvfail audit: error: {' '.join(message.split())}\n")

    def parse_known(args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        # As a subcommand, leftovers would go up to the ``kvfail`` parser and its usage.
        ns, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    p.error = error  # type: ignore[method-assign]
    p.parse_known_args = parse_known  # type: ignore[method-assign]


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Options shared by ``kvfail audit`` and the standalone entry point."""
    _one_line_errors(p)
    p.add_argument("--quick", action="store_true", help="static tier only (source reading)")
    p.add_argument("--format", choices=sorted(RENDERERS), default="table", dest="fmt")
    p.add_argument("--output", "-o", type=Path, help="write the report here instead of stdout")
    p.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="NAME",
        help="registry name, vllm:<RegistryName>, entry-point name or module:Class (repeatable)",
    )
    p.add_argument(
        "--fail-on",
        choices=["must", "should", "never"],
        default="must",
        help="exit 1 when a connector violates a rule of this level or stronger",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--policy",
        choices=["fail", "recompute", "both"],
        default="fail",
        help="kv_load_failure_policy for the dynamic tier (default fail: what a connector "
        "reports does not depend on it, and one policy halves the run)",
    )
    p.add_argument(
        "--layout",
        action="append",
        default=None,
        type=_layout,
        metavar="L",
        help="engine layout(s) for the dynamic tier: "
        + " | ".join(layout.name for layout in ALL_LAYOUTS)
        + " | all (repeatable; default tp1, the audit's profile: one policy, one layout)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=None,
        metavar="N",
        help="rows the dynamic tier runs at once, on pytest-xdist workers (default: the "
        "machine's cores + 1, at most 4: a row mostly waits on peers and deadlines; "
        "0: one after another)",
    )
    p.add_argument(
        "--budget-s",
        type=_budget,
        default=_DEFAULT_BUDGET_S,
        metavar="S",
        help="wall-clock budget of the whole audit in seconds (default "
        f"{_DEFAULT_BUDGET_S:g}; 0: none). Scenarios the dynamic tier cannot start within "
        "it are reported as not run (budget), never as results",
    )


def add_parser(subparsers: Any) -> None:
    """Register ``audit`` on the ``kvfail`` command's subparsers."""
    p = add_command(
        subparsers,
        "audit",
        __doc__,
        "compliance matrix of KV connectors against the load-error contract",
    )
    configure_parser(p)
    p.set_defaults(audit_run=run)


class _Progress:
    """One ``[i/n] auditing X...`` line on stderr, redrawn in place on a terminal."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()

    def step(self, i: int, n: int, text: str) -> None:
        self.message(f"[{i}/{n}] {text}")

    def message(self, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def collect(
    selectors: list[str],
    *,
    quick: bool,
    dynamic_runner: DynamicRunner | None,
    progress: _Progress,
) -> Audit:
    """Discover connectors and run the tiers; the report layer only formats the result."""
    start = time.monotonic()
    with _no_gc():
        return _collect(selectors, quick, dynamic_runner, progress, start)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The static tier parses ~140 modules into ASTs it keeps: every object it allocates
    lives to the end, so the cyclic collector would only rescan them, a large share of
    the tier's CPU time. Off while the audit runs."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _collect(
    selectors: list[str],
    quick: bool,
    dynamic_runner: DynamicRunner | None,
    progress: _Progress,
    start: float,
) -> Audit:
    index = SourceIndex()
    targets = discover(index, selectors=selectors or None)
    graph = Graph(index)
    note: str | None = None
    if quick:
        note = "skipped (--quick)"
    elif dynamic_runner is None:
        note = (
            "unavailable: no conformance runner is registered (kvfail.audit.cli."
            "DYNAMIC_RUNNER / run(..., dynamic_runner=...)); static tier only"
        )
    n = len(targets)
    rows: list[Row] = []
    assess = Assessor(index, graph)
    driven, eps = driven_refs(index), driver_entry_points()
    for i, target in enumerate(targets, start=1):
        progress.step(i, n, f"auditing {target.name} (static)...")
        row = Row(target, audit_target(target, index, graph))
        row.driver = driver_for(target.name, target.ref, graph, driven, eps)
        # A driven row needs no reason (and the walk of a large connector costs seconds).
        row.applicability = assess(target.ref) if row.driver is None else None
        if target.origin == "vllm-registry":
            row.pending = DRIVERS_PENDING.get(target.name)
        rows.append(row)
    if dynamic_runner is not None and not quick:
        # A Guard(X) row for every row with a driver, shown after them all (the dynamic
        # tier runs each right after its inner: kvfail.audit.dynamic.run_order). Its
        # cells are dynamic only: the guard's source is one class, not X's.
        rows += [
            Row(guard_target(r.target), driver=f"guard:{r.driver}")
            for r in list(rows)
            if _guardable(r)
        ]
        targets = [r.target for r in rows]
        # After the static tier, so the dynamic tier's budget counts what the static took.
        prepare = getattr(dynamic_runner, "prepare", None)
        if prepare is not None:
            installed = [t for t in targets if t.installed]
            progress.message(f"dynamic tier: conformance suite over {len(installed)} connectors")
            prepare(installed, progress=progress.message)
        for i, row in enumerate(rows, start=1):
            if not row.target.installed:
                continue
            if prepare is None:  # a runner that does its work per connector
                progress.step(i, n, f"auditing {row.target.name} (dynamic)...")
            try:
                row.findings.extend(dynamic_runner(row.target))
            except Exception as exc:  # one connector's harness failure must not end the run
                row.target.notes.append(f"dynamic tier failed: {type(exc).__name__}: {exc}")
    progress.done()
    return Audit(rows, columns_for(rows), note, time.monotonic() - start)


def _guardable(row: Row) -> bool:
    """A row the guard can wrap for the dynamic tier: it has a driver, is installed, and
    is not kvfail's own (those already hold the contract the guard adds)."""
    target = row.target
    return row.driver is not None and target.installed and target.origin != "kvfail"


def _process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports), from
    ``/proc``; 0 where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rfind(")") + 2 :].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def command_started_at() -> float:
    """When this command started, on ``time.monotonic()``'s clock: its interpreter
    start-up and imports count against ``--budget-s`` too. Only a command's entry point
    may use it (a process that runs :func:`run` later, such as a test worker, is older
    than the audit)."""
    return time.monotonic() - _process_age_s()


def run(
    args: argparse.Namespace,
    dynamic_runner: DynamicRunner | None = None,
    *,
    started_at: float | None = None,
) -> int:
    """Run the audit for parsed ``args``; returns the process exit status.

    ``started_at`` (``time.monotonic()``): when the audit began, from which ``--budget-s``
    counts; the command's entry points pass :func:`command_started_at`, a caller in a
    process of its own leaves it (now).
    """
    start = time.monotonic() if started_at is None else started_at
    runner = dynamic_runner if dynamic_runner is not None else DYNAMIC_RUNNER
    if runner is None and not args.quick:
        from kvfail.audit.dynamic import ConformanceRunner

        runner = ConformanceRunner(
            budget_s=getattr(args, "budget_s", _DEFAULT_BUDGET_S),
            policy=getattr(args, "policy", "fail"),
            start=start,
            layouts=getattr(args, "layout", None) or ["tp1"],
            workers=getattr(args, "workers", None),
        )
    progress = _Progress(sys.stderr, not getattr(args, "no_progress", False))
    try:
        audit = collect(args.connector, quick=args.quick, dynamic_runner=runner, progress=progress)
    except UsageError as exc:  # raised before any tier ran
        print(f"kvfail audit: error: {exc}", file=sys.stderr)
        return 2
    if audit.dynamic_note and not args.quick:
        print(f"kvfail audit: dynamic tier {audit.dynamic_note}", file=sys.stderr)
    incomplete = getattr(runner, "incomplete", None)
    if incomplete is not None and not args.quick:
        audit.dynamic_incomplete = incomplete()
    if not args.quick:
        patches = getattr(runner, "rig_patches", None)
        audit.rig_patches = None if patches is None else list(patches)
    if audit.dynamic_incomplete:
        print(f"kvfail audit: dynamic tier incomplete: {audit.dynamic_incomplete}", file=sys.stderr)
    text = RENDERERS[args.fmt](audit)
    if args.output:
        args.output.write_text(text, encoding="utf-8")
        print(f"kvfail audit: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return exit_status(audit, args.fail_on)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m kvfail.audit.cli``), same options as ``kvfail audit``."""
    parser = argparse.ArgumentParser(prog="kvfail audit", description=__doc__)
    configure_parser(parser)
    return run(parser.parse_args(argv), started_at=command_started_at())


if __name__ == "__main__":
    sys.exit(main())
