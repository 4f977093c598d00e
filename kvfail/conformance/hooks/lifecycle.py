"""A conformance session from configure to close: parametrise the scenarios over
connector x policy x layout, hand each its context, stop each driver after its last
scenario, apply the coverage gate, and close every peer.

Why parametrised here (SQLAlchemy's ``--dburi``): the scenarios are written once, so an
out-of-tree connector runs the same suite with one flag. Hooks are inert for tests
that use neither the ``scenario`` fixture nor its old name ``kvfail``, so loading the
plugin globally changes no other test run.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Generator, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvfail.conformance.baseline import Baseline, BaselineError
from kvfail.conformance.hooks import distributed, options, reporting, shm_sweep, verdicts
from kvfail.conformance.hooks.state import (
    PHASES,
    STATE,
    PatchLog,
    SessionState,
    is_suite_item,
)
from kvfail.conformance.layout import DEFAULT_LAYOUT, POLICIES, Layout, parse_layout_policies
from kvfail.conformance.report import RECORDS_FILE
from kvfail.conformance.resolve import spec_problem

if TYPE_CHECKING:
    from kvfail.conformance.suite import ScenarioContext

#: ``KVFAIL_P_PRESTART=0`` leaves the P zygote to start when a driver first wants P.
_PRESTART_ENV = "KVFAIL_P_PRESTART"
#: The IPC directory this session made (see ``kvfail.rig.shm.session_ipc_dir``), to remove.
_OWN_IPC_DIR = pytest.StashKey[str]()
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
    from kvfail.rig.processes import close_peers_on_sigterm

    close_peers_on_sigterm()  # a run stopped with SIGTERM still closes its peers
    # Claim the shared-memory prefix before any peer starts, so peers inherit it and the
    # end-of-session sweep (which only the owner runs) covers their TP worlds too: a NIXL
    # producer started first had taken a prefix of its own, left behind after the run.
    shm.session_prefix()
    # Only the session that made the IPC directory removes it: a pytester run inside this
    # process (the selftest) is a session too, and shares the directory with its host.
    if not os.environ.get(shm.IPC_ENV):
        config.stash[_OWN_IPC_DIR] = shm.session_ipc_dir()
    shm_sweep.snapshot()
    config.addinivalue_line("markers", "clauses(*ids): contract clauses a scenario exercises")
    config.addinivalue_line("markers", "guards(*issues): upstream issues a scenario guards")
    # Each connector's scenarios carry one (see hooks.distributed); xdist, when installed,
    # registers the same marker.
    config.addinivalue_line("markers", "xdist_group(name): scenarios one xdist worker runs")
    policy = config.getoption("--policy", default="both")
    try:
        layouts, layout_policies = parse_layout_policies(options.layouts(config))
    except ValueError as exc:
        raise pytest.UsageError(f"--layout: {exc}") from None
    connectors = options.connectors(config)
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
    config.stash[STATE] = SessionState(
        connectors=connectors,
        policies=list(POLICIES) if policy == "both" else [policy],
        layouts=layouts,
        layout_policies=layout_policies,
        report_dir=config.getoption("--kvfail-report", default=None),
        silent_wait_s=float(config.getoption("--kvfail-silent-wait", default=6.0)),
        require_drivers=options.drivers_required(config),
        baseline=baseline,
        write_baseline=config.getoption("--kvfail-write-baseline", default=None),
        patches=PatchLog(),
        seed=config.getoption("--kvfail-seed", default=None),
        soak_batches=options.soak_batches(config),
    )
    state = config.stash[STATE]
    worker = distributed.is_worker(config)
    if worker:  # the controller writes the run's one report and baseline
        state.report_dir = state.write_baseline = None
    elif distributed.is_controller(config):
        config.pluginmanager.register(distributed.Merger(config), "kvfail-merge")
    report_dir = state.report_dir
    if report_dir:  # records.jsonl is appended to as scenarios end: this run's only
        (Path(report_dir) / RECORDS_FILE).unlink(missing_ok=True)
    given = list(config.getoption("--connector", default=[]) or [])
    # Not on a distributed run: its controller runs no scenario, and a worker does not
    # know yet whether it will get a connector's scenarios.
    distributing = worker or distributed.is_controller(config)
    if given and not distributing and os.environ.get(_PRESTART_ENV, "1") != "0":
        from kvfail.conformance.resolve import entry_point_modules
        from kvfail.conformance.shared_producers import prestart_for

        # After the environment above is set (the zygote inherits it): P's import now
        # overlaps this process's own, which collection is about to do. Only for a
        # connector named on the command line: the ini's default list is there for every
        # run of the checkout, most of which start no P.
        prestart_for(given, entry_point_modules())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvfail_connector" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[STATE]
    only = state.layout_policies
    combos = [
        (c, p, layout)
        for c in state.connectors
        for p in state.policies
        for layout in state.layouts
        if p in only.get(layout, (p,))
    ]
    # The default layout keeps the historical ids (connector-policy). One xdist group per
    # connector: its scenarios share its driver's peers (see hooks.distributed).
    params = [
        pytest.param(
            c,
            p,
            layout,
            id=f"{c}-{p}" if layout == DEFAULT_LAYOUT else f"{c}-{p}-{layout.name}",
            marks=distributed.group_mark(c),
        )
        for c, p, layout in combos
    ]
    metafunc.parametrize(("kvfail_connector", "kvfail_policy", "kvfail_layout"), params)


@pytest.fixture
def scenario(
    request: pytest.FixtureRequest,
    kvfail_connector: str,
    kvfail_policy: str,
    kvfail_layout: Layout,
) -> Iterator[ScenarioContext]:
    """The scenario context: one connector under one policy and layout for one scenario."""
    from kvfail.conformance import timebase
    from kvfail.conformance.suite import ScenarioContext, SuiteSkip

    state = request.config.stash[STATE]
    scale = timebase.measure()
    driver = state.driver(kvfail_connector)
    if driver is None:
        if kvfail_connector in state.broken:
            pytest.fail(state.broken[kvfail_connector], pytrace=False)
        why = f"driver unavailable: {state.unavailable[kvfail_connector]}"
        if state.require_drivers:
            pytest.fail(f"{why} (--kvfail-require-drivers)", pytrace=False)
        raise SuiteSkip(why, ("driver",))
    ctx = ScenarioContext(
        driver=driver,
        caps=state.caps[kvfail_connector],
        policy=kvfail_policy,  # type: ignore[arg-type]
        scenario=request.node.originalname,
        # The machine's time now: every verdict-deciding wait of this scenario is
        # stretched by how much a loaded machine slows it (kvfail.conformance.timebase).
        silent_wait_s=timebase.scaled(state.silent_wait_s),
        node=request.node,
        layout=kvfail_layout,
        require_drivers=state.require_drivers,
        seed=state.seed,
        soak_batches=state.soak_batches,
    )
    ctx.note("time_scale", round(scale, 2))
    ctx.require(*kvfail_layout.requires)
    try:
        yield ctx
    finally:
        phases = request.node.stash.get(PHASES, [])
        ctx.close(failed=any(report.failed for _, report in phases))


@pytest.fixture
def kvfail(scenario: ScenarioContext) -> ScenarioContext:
    """Deprecated alias of ``scenario`` (its old name), kept so scenarios written against
    it still run; new scenarios take ``scenario``."""
    return scenario


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Resolve every connector the collected scenarios use, before any of them runs: a
    ``module:Class`` that cannot be imported is a usage error, not a run of skips. Each
    scenario renders its own failures (see ``verdicts.render_failure``)."""
    state = config.stash.get(STATE, None)
    if state is None:
        return
    specs = set()
    for item in items:
        if is_suite_item(item) and hasattr(item, "callspec"):
            specs.add(str(item.callspec.params["kvfail_connector"]))
            verdicts.own_failure_rendering(item)
    for spec in sorted(specs):
        state.resolve(spec)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note where each connector's last scenario is in the final order (after every plugin
    reordered the items), so its driver can stop as soon as that scenario ends."""
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    for index, item in enumerate(session.items):
        if is_suite_item(item) and hasattr(item, "callspec"):
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
    state = item.config.stash.get(STATE, None)
    if state is not None and is_suite_item(item) and hasattr(item, "callspec"):
        spec = str(item.callspec.params["kvfail_connector"])
        index = state.item_index.get(item.nodeid, -1)
        if index >= 0 and state.last_index.get(spec) == index:
            release(state, spec, index)
    return result


def release(state: SessionState, spec: str, index: int) -> None:
    """Stop ``spec``'s driver; then close the P's its kind handed off, unless a connector
    still to run has a driver of the same kind (it would take that P over)."""
    from kvfail.conformance.shared_producers import close_shared_producers

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


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The coverage gate (see ``hooks.coverage``), then the report's final form. First
    among the hooks, so that whatever records the exit status sees the gate's."""
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    if distributed.is_worker(session.config):
        # A worker saw a share of the scenarios: the controller gates the merged set.
        if state.patches is not None:
            apps = [asdict(a) for a in state.patches.take_unsent()]
            session.config.workeroutput[distributed.PATCHES_KEY] = apps  # type: ignore[attr-defined]
        return
    state.unverified = state.coverage.unverified()
    if state.unverified and session.exitstatus in (pytest.ExitCode.OK, 0):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporting.finish(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    try:
        reporting.finish(config)  # a session that never reached its end
        _close_session(config)
    finally:
        if config.stash.get(_OWN_IPC_DIR, None):
            from kvfail.rig import shm

            shm.release_ipc_dir()


def _close_session(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is None:
        return
    if state.patches is not None:
        state.patches.close()
    from kvfail.conformance.shared_producers import close_shared_producers

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
        shm_sweep.sweep(outermost=outermost)
        if outermost and state.froze:
            # One full collection now (an exception in a finaliser is still reported, the
            # session's hooks are in place), then freeze what survives: pytest's own five
            # collections at exit then walk almost nothing (see pytest_collection_finish).
            gc.collect()
            gc.freeze()
