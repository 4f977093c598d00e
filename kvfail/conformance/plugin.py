"""pytest plugin: ``pytest conformance/ --connector X [--policy P] [--kvfail-report DIR]``.

Why a plugin (registered as the ``pytest11`` entry point ``kvfail``, or loaded by
``conformance/conftest.py`` until then): the scenarios are written once and parametrised
over connector x policy here, so an out-of-tree connector runs the same suite with one
flag, as SQLAlchemy's ``--dburi``. The plugin also enforces the outcome vocabulary: a
conformance skip must name a missing capability (or an unavailable driver); any other
skip is turned into a failure, so nothing can be hidden. At the end it prints the matrix
per connector and, with ``--kvfail-report``, writes ``report.json`` / ``report.md``.

Hooks are inert for tests that do not use the ``kvfail`` fixture, so loading the plugin
globally does not change any other test run.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest

from kvfail.conformance.capabilities import SKIP_PREFIXES, Capabilities
from kvfail.conformance.layout import DEFAULT_LAYOUT, Layout, parse_layouts
from kvfail.conformance.report import Outcome, Record, render_durations, render_matrix

__all__ = ["KNOWN_FINDINGS", "LAYOUT_FINDINGS"]

POLICIES = ("fail", "recompute")
DEFAULT_CONNECTOR = "toy"

#: Upstream findings, recorded as STRICT xfails (never hidden): (connector class, scenario)
#: -> reason; ``{wait}`` is replaced by the suite's bounded wait (``--kvfail-silent-wait``).
_SOCKET_TIMEOUT = (
    "not detected within {wait} s (upstream D socket timeout is "
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT+60 s, #35943)"
)
KNOWN_FINDINGS: dict[tuple[str, str], str] = {
    ("MooncakeConnector", "test_silent_peer_caught_by_deadline"): (
        "C10 / #35943: upstream MooncakeConnector's D side gives up on a silent bootstrap "
        "only after 3 x VLLM_MOONCAKE_CONNECTOR_TIMEOUT (90 s), far beyond the suite's "
        "wait of {wait} s"
    ),
    ("MooncakeConnector", "test_frozen_peer_caught_by_deadline"): "C10: " + _SOCKET_TIMEOUT,
    ("MooncakeConnector", "test_peer_killed_after_warm_pull"): (
        "C10: ZMQ never notices a dead peer; " + _SOCKET_TIMEOUT
    ),
    ("MooncakeConnector", "test_params_missing_transfer_id"): (
        "C1/C10: upstream 0.32.0 accepts kv_transfer_params without transfer_id; the "
        "request stays in WAITING_FOR_REMOTE_KVS with its blocks held and is not reported "
        "within {wait} s (observed)"
    ),
    ("MooncakeConnector", "test_tp2_failure_on_one_rank"): (
        "C10/C11: P's TP rank 1 SIGKILLed (rank 0 serves its pull): upstream's D rank 1 "
        "waits on a ZMQ socket that never notices the dead peer; the request stays in "
        "WAITING_FOR_REMOTE_KVS past the suite's bound (socket timeout "
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT+60 s, #35943)"
    ),
    ("MooncakeConnector", "test_peer_finishes_without_result"): (
        "C1/C10: upstream 0.32.0 leaves the pull loop on a FINISH reply that names no "
        "request and never reports it: the request is stranded (not reported within "
        "{wait} s; the socket timeout no longer applies)"
    ),
}


#: Upstream findings that hit every failed load in a layout, whatever the scenario:
#: (connector class, capability the layout requires) -> reason. Each scenario that
#: expects a failed load in such a layout is a STRICT xfail with this reason.
LAYOUT_FINDINGS: dict[tuple[str, str], str] = {
    ("NixlPullConnector", "two_groups"): (
        "C5 / HMA TODO: upstream NixlConnector (class NixlPullConnector) picks "
        "block-level reporting by 'the model has a non-full-attention layer', not by "
        "KV-cache group count; with two full-attention groups a failed load is reported "
        "in invalid_block_ids as well as failed_recving, and the scheduler raises "
        "RuntimeError (the engine dies)"
    ),
}


def layout_finding(connector: str, layout: Layout) -> str | None:
    """The known finding every failed load of ``connector`` meets in ``layout``, if any."""
    for (name, needs), reason in LAYOUT_FINDINGS.items():
        if name == connector and needs in layout.requires:
            return reason
    return None


@dataclass
class _State:
    connectors: list[str]
    policies: list[str]
    layouts: list[Layout]
    report_dir: str | None
    silent_wait_s: float
    finding_wait_s: float = 3.0
    drivers: dict[str, Any] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    caps: dict[str, Capabilities] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    session_start: float = field(default_factory=time.monotonic)

    def driver(self, spec: str) -> Any:
        """Resolve and start the driver once; None (with ``unavailable[spec]``) if it cannot run."""
        if spec in self.unavailable:
            return None
        if spec in self.drivers:
            return self.drivers[spec]
        from kvfail.conformance.driver import DriverUnavailable, resolve

        try:
            driver = resolve(spec)
        except DriverUnavailable as exc:
            self.unavailable[spec] = str(exc)
            return None
        why = driver.unavailable()
        if why is None:
            try:
                driver.start()
                self.started.add(spec)
            except Exception as exc:
                why = f"{spec} failed to start ({type(exc).__name__}: {exc})"
        self.drivers[spec] = driver
        try:
            self.caps[spec] = driver.capabilities()
        except Exception as exc:
            why = why or f"capabilities of {spec} cannot be derived ({type(exc).__name__}: {exc})"
        if why is not None:
            self.unavailable[spec] = why
            return None
        return driver


_STATE = pytest.StashKey[_State]()
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
        "(TP size x KV-cache groups; repeatable or comma-separated; replaces the ini option "
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
        "--kvfail-finding-wait",
        type=float,
        default=3.0,
        help="seconds the suite waits in a scenario marked by a known finding (a strict "
        "xfail: if the connector now passes within this wait, the run fails; default 3)",
    )
    group.addoption(
        "--kvfail-silent-wait",
        type=float,
        default=6.0,
        help="seconds the suite waits for a connector's own deadline on a silent peer, and "
        "for a known finding to show (default 6)",
    )


def pytest_configure(config: pytest.Config) -> None:
    from kvfail import shm
    from kvfail.faults.process import close_peers_on_sigterm

    close_peers_on_sigterm()  # a run stopped with SIGTERM still closes its peers
    # Claim the shared-memory prefix before any peer starts, so peers inherit it and the
    # end-of-session sweep (which only the owner runs) covers their TP worlds too: a NIXL
    # producer started first had taken a prefix of its own, left behind after the run.
    shm.session_prefix()
    _SHM_BEFORE.update(shm.segment_names())
    config.addinivalue_line("markers", "clauses(*ids): contract clauses a scenario exercises")
    config.addinivalue_line("markers", "guards(*issues): upstream issues a scenario guards")
    policy = config.getoption("--policy", default="both")
    config.stash[_STATE] = _State(
        connectors=_connectors(config),
        policies=list(POLICIES) if policy == "both" else [policy],
        layouts=parse_layouts(_layouts(config)),
        report_dir=config.getoption("--kvfail-report", default=None),
        silent_wait_s=float(config.getoption("--kvfail-silent-wait", default=6.0)),
        finding_wait_s=float(config.getoption("--kvfail-finding-wait", default=3.0)),
    )


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
    combos = [
        (c, p, layout) for c in state.connectors for p in state.policies for layout in state.layouts
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
        pytest.skip(f"driver unavailable: {state.unavailable[kvfail_connector]}")
    caps = state.caps[kvfail_connector]
    scenario = request.node.originalname
    finding = KNOWN_FINDINGS.get((caps.connector, scenario))
    wait = state.silent_wait_s
    if finding is not None:
        # A known finding only has to show again: wait less (strict, so a fix still shows).
        wait = min(wait, state.finding_wait_s)
        reason = finding.format(wait=f"{wait:g}")
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))
    # A scenario-specific finding already makes it a strict xfail.
    per_layout = None if finding is not None else layout_finding(caps.connector, kvfail_layout)
    ctx = ScenarioContext(
        driver=driver,
        caps=caps,
        policy=kvfail_policy,  # type: ignore[arg-type]
        scenario=scenario,
        silent_wait_s=wait,
        node=request.node,
        layout=kvfail_layout,
        failed_load_finding=per_layout,
        layout_findings=None if finding is not None else partial(layout_finding, caps.connector),
    )
    ctx.require(*kvfail_layout.requires)
    try:
        yield ctx
    finally:
        ctx.close()


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
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not reason.startswith(SKIP_PREFIXES):
            report.outcome = "failed"
            report.longrepr = (
                f"unexplained skip (a conformance skip must name a missing capability: "
                f"'requires <capability>: ...'): {reason}"
            )
    if report.failed and call.excinfo is not None:
        item.stash.setdefault(_FAILURE, str(call.excinfo.value).strip()[:2000])
    item.stash.setdefault(_PHASES, []).append((call.when, report))
    if call.when == "teardown":
        _record(item)
    return report


_FAILURE = pytest.StashKey[str]()


def _record(item: pytest.Item) -> None:
    state = item.config.stash[_STATE]
    phases = item.stash.get(_PHASES, [])
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return
    outcome: Outcome = "passed"
    reason = ""
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
    state.records.append(
        Record(
            connector=str(callspec.params["kvfail_connector"]),
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
        )
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.records:
        return
    tr = terminalreporter
    tr.write_sep("=", "kvfail conformance matrix")
    for spec, caps in state.caps.items():
        have = [
            n
            for n in (
                "async_load",
                "sync_load",
                "request_level_failures",
                "block_level_failures",
                "hma",
                "has_deadline",
                "real_transport",
                "tp2",
                "byte_verification",
            )
            if getattr(caps, n)
        ]
        tr.write_line(f"{spec}: {caps.connector} via driver {caps.driver}; has {', '.join(have)}")
    for spec, why in state.unavailable.items():
        tr.write_line(f"{spec}: driver unavailable: {why}")
    tr.write_line("")
    tr.write_line(render_matrix(state.records))
    tr.write_sep("-", "kvfail scenario durations")
    tr.write_line(render_durations(state.records))
    if state.report_dir:
        from kvfail.conformance.report import write_report

        caps_json = {spec: c.as_dict() for spec, c in state.caps.items()}
        json_path, md_path = write_report(state.report_dir, state.records, caps_json)
        tr.write_line(f"kvfail report: {json_path} {md_path}")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    from kvfail.conformance.driver import close_shared_producers

    try:
        for spec in list(state.started):
            driver = state.drivers.get(spec)
            if driver is not None:
                driver.stop()
        state.started.clear()
    finally:
        close_shared_producers()  # the P's drivers handed off when they stopped
        _sweep_shared_memory()


#: /dev/shm ``psm_*`` names that existed when the session started (see the sweep).
_SHM_BEFORE: set[str] = set()


def _sweep_shared_memory() -> None:
    """Remove the TP worlds' shared memory this session left (killed peers' ranks), and
    the ``psm_*`` message-queue segments of killed vLLM processes created since the session
    began that no live process uses (one default run had left 17, 24 MB each)."""
    from kvfail import shm

    if shm.owns_session_prefix():
        shm.release_orphans(_SHM_BEFORE)
        shm.release_shared_memory(shm.session_prefix())
