"""pytest plugin: ``pytest conformance/ --connector X [--policy P] [--kvfail-report DIR]``.

Why a plugin (registered as the ``pytest11`` entry point ``kvfail``, or loaded by
``conformance/conftest.py`` until then): the scenarios are written once and parametrised
over connector x policy here, so an out-of-tree connector runs the same suite with one
flag, as SQLAlchemy's ``--dburi``. The plugin also enforces the outcome vocabulary: a
conformance skip must name a missing capability (or an unavailable driver); any other
skip is turned into a failure, so nothing can be hidden; a harness that needs a vLLM feature
the installed vLLM lacks (:class:`kvfail.compat.MissingFeatureError`) ends the scenario in
an ``error`` record, never a verdict. At the end it prints the matrix
per connector and the rig patches applied to the system under test
(:mod:`kvfail.rig.patches`), and, with ``--kvfail-report``, writes ``report.json`` /
``report.md``. The clauses each scenario cites are defined in ``docs/contract.md``.

Hooks are inert for tests that do not use the ``kvfail`` fixture, so loading the plugin
globally does not change any other test run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvfail.compat import MISSING_FEATURE_MARK, MissingFeatureError
from kvfail.conformance.baseline import Baseline, BaselineError, Entry, clauses_of
from kvfail.conformance.capabilities import SKIP_PREFIXES, Capabilities
from kvfail.conformance.layout import DEFAULT_LAYOUT, POLICIES, Layout, parse_layout_policies
from kvfail.conformance.report import (
    RECORDS_FILE,
    Outcome,
    Record,
    append_record,
    render_durations,
    render_matrix,
    render_patches,
)
from kvfail.conformance.resolve import spec_problem
from kvfail.rig import patches as rig_patches

__all__ = ["POLICIES"]

DEFAULT_CONNECTOR = "toy"
#: ``KVFAIL_P_PRESTART=0`` leaves the P zygote to start when a driver first wants P.
_PRESTART_ENV = "KVFAIL_P_PRESTART"


@dataclass
class _State:
    connectors: list[str]
    policies: list[str]
    layouts: list[Layout]
    report_dir: str | None
    silent_wait_s: float
    #: ``--kvfail-require-drivers``: a driver that cannot run here fails, never skips.
    require_drivers: bool = False
    baseline: Baseline | None = None
    write_baseline: str | None = None
    drivers: dict[str, Any] = field(default_factory=dict)
    #: Drivers that cannot run here (their transport is absent): spec -> why.
    unavailable: dict[str, str] = field(default_factory=dict)
    #: Drivers that should run but broke (start or capabilities raised): spec -> why.
    broken: dict[str, str] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    caps: dict[str, Capabilities] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    session_start: float = field(default_factory=time.monotonic)
    #: The rig-patch log every process of this run appends to (see ``_PatchLog``).
    patches: _PatchLog | None = None
    #: Layouts limited to some policies (``tp2-g2:recompute``), with those policies.
    layout_policies: dict[Layout, frozenset[str]] = field(default_factory=dict)
    #: Position of each connector's last scenario, and of every item, in the run's order.
    last_index: dict[str, int] = field(default_factory=dict)
    item_index: dict[str, int] = field(default_factory=dict)
    #: Whether this run froze the collector's heap (a run with scenarios; see
    #: ``pytest_collection_finish``).
    froze: bool = False

    def resolve(self, spec: str) -> Any:
        """The driver for ``spec``, resolved once (not started). Raises
        :class:`pytest.UsageError` when ``spec`` names no connector: a typo must stop the
        run, not turn into a row of skips."""
        if spec in self.drivers:
            return self.drivers[spec]
        from kvfail.conformance.driver import DriverUnavailable
        from kvfail.conformance.resolve import resolve

        try:
            driver = resolve(spec)
        except DriverUnavailable as exc:
            raise pytest.UsageError(f"--connector {spec}: {exc}") from None
        except Exception as exc:
            raise pytest.UsageError(
                f"--connector {spec}: cannot be resolved ({type(exc).__name__}: {exc})"
            ) from None
        self.drivers[spec] = driver
        return driver

    def driver(self, spec: str) -> Any:
        """The started driver; None (with ``unavailable`` or ``broken`` set) if it cannot run.

        Why two outcomes: a transport that is not installed here is a fact about this
        machine (a named skip, or a failure under ``--kvfail-require-drivers``); a driver
        whose start raises is a broken rig or a crashing peer, which must never look like
        a skip."""
        if spec in self.unavailable or spec in self.broken:
            return None
        driver = self.resolve(spec)
        if spec in self.caps:
            return driver
        why = driver.unavailable()
        if why is not None:
            self.unavailable[spec] = why
            return None
        # Marked started first: a start that raises half-way still gets its stop (which is
        # idempotent), so no peer it spawned outlives the session.
        self.started.add(spec)
        try:
            driver.start()
            self.caps[spec] = driver.capabilities()
        except Exception as exc:
            self.broken[spec] = f"{spec}: driver failed to start ({type(exc).__name__}: {exc})"
            return None
        # A started driver has imported what its engines need (vLLM imports much of itself
        # lazily, at the first engine) and holds peers for the session: freeze them with
        # the rest (see pytest_collection_finish).
        gc.freeze()
        return driver


class _PatchLog:
    """This run's rig-patch records (:mod:`kvfail.rig.patches`), from every process.

    Why a file: patches take effect in D's TP rank processes and in P processes too; the
    path goes to them through ``$KVFAIL_RIG_PATCH_LOG``, which children inherit. Records
    are read as each scenario ends and credited to that scenario's connector: a patch is
    process-wide or made while that connector's engines were built, so a connector's
    records list what it ran under so far."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvfail-rig-patches-", suffix=".jsonl")
        os.close(fd)
        self.previous = os.environ.get(rig_patches.LOG_ENV)
        os.environ[rig_patches.LOG_ENV] = self.path
        self.offset = 0
        self.applied: list[rig_patches.Application] = []
        self.by_connector: dict[str, set[str]] = {}

    def credit(self, connector: str) -> list[str]:
        """Read what was recorded since the last call; the patches ``connector`` ran under."""
        new, self.offset = rig_patches.read_log(self.path, self.offset)
        self.applied += new
        names = self.by_connector.setdefault(connector, set())
        names.update(a.name for a in new)
        return [n for n in rig_patches.CATALOGUE if n in names]

    def summary(self) -> list[dict[str, Any]]:
        new, self.offset = rig_patches.read_log(self.path, self.offset)
        self.applied += new
        out = rig_patches.summarize(self.applied)
        for entry in out:
            entry["connectors"] = sorted(
                c for c, names in self.by_connector.items() if entry["name"] in names
            )
        return out

    def close(self) -> None:
        if os.environ.get(rig_patches.LOG_ENV) == self.path:
            if self.previous is None:
                os.environ.pop(rig_patches.LOG_ENV, None)
            else:
                os.environ[rig_patches.LOG_ENV] = self.previous
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_STATE = pytest.StashKey[_State]()
#: The IPC directory this session made (see ``kvfail.rig.shm.session_ipc_dir``), to remove.
_OWN_IPC_DIR = pytest.StashKey[str]()
_PHASES = pytest.StashKey[list[tuple[str, pytest.TestReport]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfail", "kvfail KV-connector conformance suite")
    group.addoption(
        "--connector",
        action="append",
        default=[],
        help="connector to test: toy | mooncake | vllm:<RegistryName> | module:Class | a "
        "kvfail.drivers entry point (repeatable; replaces the ini option kvfail_connectors, "
        f"whose default is {DEFAULT_CONNECTOR})",
    )
    parser.addini(
        "kvfail_connectors",
        type="args",
        default=[],
        help="connectors the suite runs when no --connector is given (space-separated; "
        f"empty: {DEFAULT_CONNECTOR})",
    )
    group.addoption(
        "--policy",
        choices=("fail", "recompute", "both"),
        default="both",
        help="kv_load_failure_policy to run each scenario under (default both)",
    )
    group.addoption(
        "--layout",
        action="append",
        default=[],
        help="engine layout(s) to run each scenario in: tp1 | tp2 | tp1-g2 | tp2-g2 | all "
        "(TP size x KV-cache groups; repeatable or comma-separated; LAYOUT:POLICY limits a "
        "layout to one policy, e.g. tp2-g2:recompute; replaces the ini option "
        "kvfail_layouts, whose default is tp1)",
    )
    parser.addini(
        "kvfail_layouts",
        type="args",
        default=[],
        help="layouts the suite runs when no --layout is given (empty: tp1)",
    )
    group.addoption(
        "--kvfail-report",
        metavar="DIR",
        default=None,
        help="write report.json, report.md and capabilities.json to DIR",
    )
    group.addoption(
        "--kvfail-baseline",
        metavar="FILE",
        default=None,
        help="TOML file of known violations to accept, each pinned to a connector class, "
        "scenario, policy, layout and its clauses (see kvfail.conformance.baseline); an "
        "entry that no longer fails fails the run",
    )
    group.addoption(
        "--kvfail-write-baseline",
        metavar="FILE",
        default=None,
        help="write this run's contract violations as a baseline file",
    )
    group.addoption(
        "--kvfail-require-drivers",
        action="store_true",
        default=None,
        help="a driver that cannot run here (transport absent) fails its scenarios instead "
        "of skipping them (also the ini option kvfail_require_drivers)",
    )
    parser.addini(
        "kvfail_require_drivers",
        type="bool",
        default=False,
        help="as --kvfail-require-drivers",
    )
    group.addoption(
        "--kvfail-silent-wait",
        type=float,
        default=6.0,
        help="seconds the suite waits for a connector's own deadline on a silent peer (default 6)",
    )


def fallback_plugins() -> list[str]:
    """What a conftest next to the scenarios lists in ``pytest_plugins``: this module, unless
    pytest already loaded it from the ``pytest11`` entry point ``kvfail`` (it refuses one
    module registered under two names)."""
    import importlib.metadata

    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        for ep in importlib.metadata.entry_points(group="pytest11"):
            if ep.value == __name__:
                return []
    return [__name__]


#: Set before collection imports vLLM: the rig never reaches a hub (the model directory is
#: local), and Mooncake's INFO lines at interpreter exit would follow pytest's summary line.
_QUIET_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MC_LOG_LEVEL": "ERROR"}


def pytest_configure(config: pytest.Config) -> None:
    from kvfail.rig import exit_status, shm

    # First: a process that must end itself (one holding NIXL agents) passes on this
    # session's status, whatever the run goes on to do.
    exit_status.watch(config)

    for key, value in _QUIET_OFFLINE.items():
        os.environ.setdefault(key, value)
    from kvfail.faults.process import close_peers_on_sigterm

    close_peers_on_sigterm()  # a run stopped with SIGTERM still closes its peers
    # Claim the shared-memory prefix before any peer starts, so peers inherit it and the
    # end-of-session sweep (which only the owner runs) covers their TP worlds too: a NIXL
    # producer started first had taken a prefix of its own, left behind after the run.
    shm.session_prefix()
    # Only the session that made the IPC directory removes it: a pytester run inside this
    # process (the selftest) is a session too, and shares the directory with its host.
    if not os.environ.get(shm.IPC_ENV):
        config.stash[_OWN_IPC_DIR] = shm.session_ipc_dir()
    global _SHM_BEFORE_TAKEN
    if not _SHM_BEFORE_TAKEN:
        _SHM_BEFORE.update(shm.segment_names())
        _SHM_BEFORE_TAKEN = True
    config.addinivalue_line("markers", "clauses(*ids): contract clauses a scenario exercises")
    config.addinivalue_line("markers", "guards(*issues): upstream issues a scenario guards")
    policy = config.getoption("--policy", default="both")
    try:
        layouts, layout_policies = parse_layout_policies(_layouts(config))
    except ValueError as exc:
        raise pytest.UsageError(f"--layout: {exc}") from None
    connectors = _connectors(config)
    for spec in connectors:
        problem = spec_problem(spec)
        if problem is not None:
            raise pytest.UsageError(f"--connector {spec}: {problem}")
    baseline = None
    path = config.getoption("--kvfail-baseline", default=None)
    if path:
        try:
            baseline = Baseline.load(path)
        except BaselineError as exc:
            raise pytest.UsageError(f"--kvfail-baseline: {exc}") from None
    config.stash[_STATE] = _State(
        connectors=connectors,
        policies=list(POLICIES) if policy == "both" else [policy],
        layouts=layouts,
        layout_policies=layout_policies,
        report_dir=config.getoption("--kvfail-report", default=None),
        silent_wait_s=float(config.getoption("--kvfail-silent-wait", default=6.0)),
        require_drivers=drivers_required(config),
        baseline=baseline,
        write_baseline=config.getoption("--kvfail-write-baseline", default=None),
        patches=_PatchLog(),
    )
    report_dir = config.stash[_STATE].report_dir
    if report_dir:  # records.jsonl is appended to as scenarios end: this run's only
        (Path(report_dir) / RECORDS_FILE).unlink(missing_ok=True)
    given = list(config.getoption("--connector", default=[]) or [])
    if given and os.environ.get(_PRESTART_ENV, "1") != "0":
        from kvfail.conformance.pair_driver import prestart_for
        from kvfail.conformance.resolve import entry_point_modules

        # After the environment above is set (the zygote inherits it): P's import now
        # overlaps this process's own, which collection is about to do. Only for a
        # connector named on the command line: the ini's default list is there for every
        # run of the checkout, most of which start no P.
        prestart_for(given, entry_point_modules())


def drivers_required(config: pytest.Config) -> bool:
    """Whether an absent transport fails instead of skipping: ``--kvfail-require-drivers``,
    else the ini ``kvfail_require_drivers``. One reading for the suite and for any test
    module that needs a transport, so the project's CI cannot skip one silently."""
    require = config.getoption("--kvfail-require-drivers", default=None)
    if require is not None:
        return bool(require)
    try:
        return bool(config.getini("kvfail_require_drivers"))
    except ValueError:  # the option is not registered (plugin loaded late)
        return False


def _layouts(config: pytest.Config) -> list[str]:
    """``--layout`` values; else the ini list ``kvfail_layouts`` (parsed by the caller)."""
    given = list(config.getoption("--layout", default=[]) or [])
    if given:
        return given
    try:
        return [str(v) for v in config.getini("kvfail_layouts")]
    except ValueError:  # the option is not registered (plugin loaded late)
        return []


def _connectors(config: pytest.Config) -> list[str]:
    """``--connector`` values; else the ini list ``kvfail_connectors``; else the toy."""
    given = list(config.getoption("--connector", default=[]) or [])
    if given:
        return given
    try:
        ini = [str(c) for c in config.getini("kvfail_connectors")]
    except ValueError:  # the option is not registered (plugin loaded late)
        ini = []
    return ini or [DEFAULT_CONNECTOR]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvfail_connector" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[_STATE]
    only = state.layout_policies
    combos = [
        (c, p, layout)
        for c in state.connectors
        for p in state.policies
        for layout in state.layouts
        if p in only.get(layout, (p,))
    ]
    # The default layout keeps the historical ids (connector-policy).
    ids = [
        f"{c}-{p}" if layout == DEFAULT_LAYOUT else f"{c}-{p}-{layout.name}"
        for c, p, layout in combos
    ]
    metafunc.parametrize(("kvfail_connector", "kvfail_policy", "kvfail_layout"), combos, ids=ids)


@pytest.fixture
def kvfail(
    request: pytest.FixtureRequest,
    kvfail_connector: str,
    kvfail_policy: str,
    kvfail_layout: Layout,
) -> Iterator[Any]:
    """The scenario context (see ``kvfail.conformance.suite.ScenarioContext``)."""
    from kvfail.conformance.suite import ScenarioContext

    state = request.config.stash[_STATE]
    driver = state.driver(kvfail_connector)
    if driver is None:
        if kvfail_connector in state.broken:
            pytest.fail(state.broken[kvfail_connector], pytrace=False)
        why = f"driver unavailable: {state.unavailable[kvfail_connector]}"
        if state.require_drivers:
            pytest.fail(f"{why} (--kvfail-require-drivers)", pytrace=False)
        pytest.skip(why)
    ctx = ScenarioContext(
        driver=driver,
        caps=state.caps[kvfail_connector],
        policy=kvfail_policy,  # type: ignore[arg-type]
        scenario=request.node.originalname,
        silent_wait_s=state.silent_wait_s,
        node=request.node,
        layout=kvfail_layout,
        require_drivers=state.require_drivers,
    )
    ctx.require(*kvfail_layout.requires)
    try:
        yield ctx
    finally:
        phases = request.node.stash.get(_PHASES, [])
        ctx.close(failed=any(report.failed for _, report in phases))


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Resolve every connector the collected scenarios use, before any of them runs: a
    ``module:Class`` that cannot be imported is a usage error, not a run of skips."""
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    specs = {
        str(item.callspec.params["kvfail_connector"])
        for item in items
        if _is_suite_item(item) and hasattr(item, "callspec")
    }
    for spec in sorted(specs):
        state.resolve(spec)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note where each connector's last scenario is in the final order (after every plugin
    reordered the items), so its driver can stop as soon as that scenario ends."""
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    for index, item in enumerate(session.items):
        if _is_suite_item(item) and hasattr(item, "callspec"):
            state.last_index[str(item.callspec.params["kvfail_connector"])] = index
    state.item_index = {item.nodeid: i for i, item in enumerate(session.items)}
    if not state.last_index:
        return  # no scenario in this run: leave the collector alone
    state.froze = True
    # Collection imported vLLM and torch: hundreds of thousands of long-lived objects that
    # every full collection would walk again (about a second each here; pytest runs five
    # at exit to surface unraisable exceptions). Frozen, they are skipped; what the
    # scenarios allocate from now on is collected as before.
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """After a connector's last scenario, stop its driver: an idle P still costs CPU (NIXL
    polls) while the other connectors run, and a run ordered connector by connector (the
    audit's) would otherwise keep every connector's peers up to the end."""
    result = yield
    state = item.config.stash.get(_STATE, None)
    if state is not None and _is_suite_item(item) and hasattr(item, "callspec"):
        spec = str(item.callspec.params["kvfail_connector"])
        index = state.item_index.get(item.nodeid, -1)
        if index >= 0 and state.last_index.get(spec) == index:
            _release(state, spec, index)
    return result


def _release(state: _State, spec: str, index: int) -> None:
    """Stop ``spec``'s driver; then close the P's its kind handed off, unless a connector
    still to run has a driver of the same kind (it would take that P over)."""
    from kvfail.conformance.pair_driver import close_shared_producers

    driver = state.drivers.get(spec)
    if driver is None or spec not in state.started:
        return
    try:
        driver.stop()
    except Exception:  # the session's teardown stops it again (stop is idempotent)
        return
    state.started.discard(spec)
    later = [s for s, last in state.last_index.items() if last > index]
    kinds = {type(state.drivers.get(s) or state.resolve(s)) for s in later}
    if type(driver) not in kinds:
        close_shared_producers(handed_off_by=type(driver))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _is_suite_item(item: pytest.Item) -> bool:
    return "kvfail" in getattr(item, "fixturenames", ())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if not _is_suite_item(item):
        return report
    missing = _missing_feature(call, report)
    if missing is not None:
        _harness_error(item, report, missing)
    elif report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not reason.startswith(SKIP_PREFIXES):
            report.outcome = "failed"
            report.longrepr = (
                f"unexplained skip (a conformance skip must name a missing capability: "
                f"'requires <capability>: ...'): {reason}"
            )
    if call.when == "call" and missing is None:
        _judge_against_baseline(item, call, report)
    if report.failed and call.excinfo is not None:
        item.stash.setdefault(_FAILURE, str(call.excinfo.value).strip()[:2000])
        violations = getattr(call.excinfo.value, "violations", None)
        if violations is not None:
            item.stash[_VIOLATIONS] = list(violations)
    item.stash.setdefault(_PHASES, []).append((call.when, report))
    if call.when == "teardown":
        _record(item)
    return report


def _missing_feature(call: pytest.CallInfo[None], report: pytest.TestReport) -> str | None:
    """The message of a :class:`MissingFeatureError` this phase ended in, wherever it
    surfaced: raised (directly, or as the cause of another error), or quoted by a skip, an
    xfail or an oracle's finding (a connector that raised it in a hook the harness
    caught). None when the phase did not meet one."""
    exc: BaseException | None = call.excinfo.value if call.excinfo is not None else None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MissingFeatureError):
            return str(exc)
        if MISSING_FEATURE_MARK in str(exc):
            return _line_with_mark(str(exc))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    xfail = str(getattr(report, "wasxfail", ""))
    if MISSING_FEATURE_MARK in xfail:
        return _line_with_mark(xfail)
    return None


def _line_with_mark(text: str) -> str:
    return next(line for line in text.splitlines() if MISSING_FEATURE_MARK in line).strip()


#: How a report starts where the tool, not the connector, is at fault.
HARNESS_ERROR = "harness error, not a verdict"


def _harness_error(item: pytest.Item, report: pytest.TestReport, missing: str) -> None:
    """Turn the phase into a failure of the run (never a pass, skip or xfail) and mark the
    scenario so its record is an ``error`` (see :func:`_record`); no baseline applies."""
    original = "" if report.skipped else f"\n\n{report.longrepr}"
    report.outcome = "failed"
    report.longrepr = f"{HARNESS_ERROR}: {missing}{original}"
    with contextlib.suppress(AttributeError):
        del report.wasxfail
    item.stash.setdefault(_MISSING, missing)


_FAILURE = pytest.StashKey[str]()
#: The :class:`MissingFeatureError` message a scenario ended in (its record is an error).
_MISSING = pytest.StashKey[str]()
#: The oracles' findings of a scenario that failed on them (not on an error).
_VIOLATIONS = pytest.StashKey[list[str]]()


def _judge_against_baseline(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> None:
    """Apply the user's baseline to one scenario's call phase (see ``baseline``).

    Only a :class:`ConformanceViolation` whose every finding cites clauses the entry names
    is absorbed; an error, or a finding of another clause, fails as it would without the
    entry. An entry whose scenario passed is *fixed* and fails the run until removed.
    """
    state = item.config.stash[_STATE]
    entry = _baseline_entry(item, state)
    if entry is None:
        return
    if report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"baseline entry fixed: {entry.describe()}, but the scenario passed; remove the "
            f"entry from {state.baseline.path}"
        )
        return
    if not report.failed or call.excinfo is None:
        return
    from kvfail.conformance.suite import ConformanceViolation

    exc = call.excinfo.value
    if not isinstance(exc, ConformanceViolation):
        return  # an error inside the scenario is never a known violation
    uncovered = entry.absorbs(exc.violations)
    if uncovered:
        report.longrepr = (
            f"{report.longrepr}\n\nbaseline entry {entry.describe()} does not cover: "
            + "; ".join(uncovered)
        )
        return
    entry.matched = True
    report.outcome = "skipped"
    report.wasxfail = f"baseline: {entry.reason or entry.describe()} | observed: " + "; ".join(
        exc.violations
    )


def _baseline_entry(item: pytest.Item, state: _State) -> Entry | None:
    callspec = getattr(item, "callspec", None)
    if state.baseline is None or callspec is None:
        return None
    spec = str(callspec.params["kvfail_connector"])
    caps = state.caps.get(spec)
    if caps is None:
        return None
    return state.baseline.lookup(
        caps.connector_path,
        getattr(item, "originalname", item.name),
        str(callspec.params["kvfail_policy"]),
        callspec.params["kvfail_layout"].name,
    )


def _record(item: pytest.Item) -> None:
    state = item.config.stash[_STATE]
    phases = item.stash.get(_PHASES, [])
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return
    outcome: Outcome = "passed"
    reason = ""
    missing = item.stash.get(_MISSING, None)
    if missing is not None:
        outcome, reason = "error", f"{HARNESS_ERROR}: {missing}"
    else:
        for _when, rep in phases:
            if rep.failed:
                outcome = "failed"
                reason = item.stash.get(_FAILURE, "") or str(rep.longrepr).strip().splitlines()[-1]
                break
            if rep.skipped:
                if hasattr(rep, "wasxfail"):
                    outcome, reason = "xfailed", str(rep.wasxfail)
                else:
                    outcome, reason = "skipped", _skip_reason(rep)
                break
    clauses = [str(a) for m in item.iter_markers("clauses") for a in m.args]
    guards = [str(a) for m in item.iter_markers("guards") for a in m.args]
    connector = str(callspec.params["kvfail_connector"])
    patched = state.patches.credit(connector) if state.patches is not None else []
    state.records.append(
        Record(
            connector=connector,
            scenario=getattr(item, "originalname", item.name),
            policy=str(callspec.params["kvfail_policy"]),
            layout=callspec.params["kvfail_layout"].name,
            outcome=outcome,
            reason=reason,
            clauses=sorted(set(clauses), key=lambda c: int(c.lstrip("C") or 0)),
            duration_s=round(sum(rep.duration for _w, rep in phases), 4),
            guards=guards,
            nodeid=item.nodeid,
            details={str(k): v for k, v in getattr(item, "user_properties", [])},
            violations=item.stash.get(_VIOLATIONS, []) if outcome == "failed" else [],
            rig_patches=patched,
        )
    )
    if state.report_dir:
        append_record(state.report_dir, state.records[-1])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.records:
        return
    tr = terminalreporter
    tr.write_sep("=", "kvfail conformance matrix (clauses: docs/contract.md)")
    for spec, caps in state.caps.items():
        have = [
            n
            for n in (
                "async_load",
                "sync_load",
                "request_level_failures",
                "block_level_failures",
                "hma",
                "real_transport",
                "tp2",
                "byte_verification",
            )
            if getattr(caps, n)
        ]
        tr.write_line(f"{spec}: {caps.connector} via driver {caps.driver}; has {', '.join(have)}")
    for spec, why in state.unavailable.items():
        tr.write_line(f"{spec}: driver unavailable: {why}")
    for spec, why in state.broken.items():
        tr.write_line(f"{spec}: DRIVER BROKEN: {why}")
    tr.write_line("")
    tr.write_line(render_matrix(state.records))
    if state.baseline is not None:
        matched = [e for e in state.baseline.entries.values() if e.matched]
        tr.write_line(
            f"kvfail baseline {state.baseline.path}: {len(matched)} of "
            f"{len(state.baseline.entries)} entries matched by their clauses in this run"
        )
    if state.write_baseline:
        path = _write_baseline(state)
        tr.write_line(f"kvfail baseline written: {path}")
    patches = state.patches.summary() if state.patches is not None else []
    tr.write_sep("-", "kvfail rig patches (docs/rig-patches.md)")
    tr.write_line(render_patches(patches))
    tr.write_sep("-", "kvfail scenario durations")
    tr.write_line(render_durations(state.records))
    if state.report_dir:
        from kvfail.conformance.report import write_report

        caps_json = {spec: c.as_dict() for spec, c in state.caps.items()}
        json_path, md_path = write_report(
            state.report_dir, state.records, caps_json, rig_patches=patches
        )
        tr.write_line(f"kvfail report: {json_path} {md_path}")


def _write_baseline(state: _State) -> str:
    """One entry per scenario run that failed on the oracles' findings, every finding
    citing a clause (an error, or a finding with no clause, is not a known violation)."""
    from kvfail.conformance.baseline import render_baseline

    entries = []
    for r in state.records:
        caps = state.caps.get(r.connector)
        cited = [clauses_of(v) for v in r.violations]
        if r.outcome == "xfailed" and state.baseline is not None and caps is not None:
            kept = state.baseline.lookup(caps.connector_path, r.scenario, r.policy, r.layout)
            if kept is not None:
                entries.append(kept)
            continue
        if r.outcome != "failed" or caps is None or not cited or not all(cited):
            continue
        entries.append(
            Entry(
                connector=caps.connector_path,
                scenario=r.scenario,
                policy=r.policy,
                layout=r.layout,
                clauses=frozenset().union(*cited),
                reason=r.violations[0][:300],
            )
        )
    path = Path(state.write_baseline or "baseline.toml")
    path.write_text(render_baseline(entries), encoding="utf-8")
    return str(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    try:
        _close_session(config)
    finally:
        if config.stash.get(_OWN_IPC_DIR, None):
            from kvfail.rig import shm

            shm.release_ipc_dir()


def _close_session(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    if state.patches is not None:
        state.patches.close()
    from kvfail.conformance.pair_driver import close_shared_producers

    try:
        for spec in list(state.started):
            driver = state.drivers.get(spec)
            if driver is not None:
                driver.stop()
        state.started.clear()
    finally:
        close_shared_producers()  # the P's drivers handed off when they stopped
        # Only the outermost session in this process waits for exiting users: a nested one
        # (the self-test's) would wait on P's the outer session still runs.
        outermost = bool(config.stash.get(_OWN_IPC_DIR, None))
        _sweep_shared_memory(outermost=outermost)
        if outermost and state.froze:
            # One full collection now (an exception in a finaliser is still reported, the
            # session's hooks are in place), then freeze what survives: pytest's own five
            # collections at exit then walk almost nothing (see pytest_collection_finish).
            gc.collect()
            gc.freeze()


#: /dev/shm ``psm_*`` names that existed when this process's first session started (see
#: the sweep). Taken once: a session nested in it (the self-test's ``pytest.main``) must
#: not add the segments its host's live P's hold by then, or the host's sweep would never
#: look at them again once those P's are killed.
_SHM_BEFORE: set[str] = set()
_SHM_BEFORE_TAKEN = False


def _sweep_shared_memory(*, outermost: bool) -> None:
    """Remove the TP worlds' shared memory this session left (killed peers' ranks), the
    ``psm_*`` message-queue segments of killed vLLM processes created since the session
    began that no live process uses (the IPC directory goes in ``pytest_unconfigure``).
    The ``outermost`` session keeps looking, bounded, at segments whose last users are
    still exiting (a closed P's rank processes unmap its queues only as they go)."""
    from kvfail.rig import shm

    if shm.owns_session_prefix():
        shm.release_orphans(_SHM_BEFORE, wait_s=shm.EXIT_WAIT_S if outermost else 0.0)
        shm.release_shared_memory(shm.session_prefix())
