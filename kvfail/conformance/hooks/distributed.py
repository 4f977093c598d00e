"""The suite under pytest-xdist (``pytest -n N``): workers run scenarios, the controller
keeps the run's one report.

Why the records ride on the test reports: xdist already sends each test's reports from
its worker to the controller, as the test ends. A scenario's teardown report carries what
its worker decided (the record, the coverage note, the connector's capabilities, the rig
patches it ran under, what became of its baseline entry), so the controller keeps the
live report, the coverage gate and the baseline's summary on the merged set exactly as a
serial run does, and a run that stops early still has every verdict a worker sent.

A worker writes no report file and applies no gate: it sees only its share of the
scenarios. Scenarios of one connector carry one ``xdist_group`` mark (that connector's
peers are started once per process and shared by its scenarios), so ``--dist loadgroup``
keeps them on one worker. Workers inherit the controller's shared-memory prefix and IPC
directory (names in both are unique per engine), and the controller, the owner, sweeps
them once every worker has ended.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.hooks.state import STATE, SessionState
from kvfail.conformance.report import Record
from kvfail.rig import patches as rig_patches

#: The attribute of a scenario's teardown report that carries its worker's payload.
PAYLOAD_ATTR = "kvfail_scenario"
#: ``workeroutput`` key: rig-patch records a worker read after its last scenario.
PATCHES_KEY = "kvfail_rig_patches"
#: The ``xdist_group`` name of a connector's scenarios.
GROUP_PREFIX = "kvfail-"


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker: runs scenarios, sends their records, writes no report."""
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """The process that distributes the run to workers (and runs no scenario itself).
    xdist's own test (``_is_distribution_mode``), read from the options it set before
    any plugin is configured."""
    if is_worker(config) or config.getoption("collectonly", default=False):
        return False
    return config.getoption("dist", default="no") != "no" and bool(
        config.getoption("tx", default=None)
    )


def group_mark(connector: str) -> pytest.MarkDecorator:
    """The ``xdist_group`` of ``connector``'s scenarios (inert without xdist)."""
    return pytest.mark.xdist_group(GROUP_PREFIX + connector)


def plain_nodeid(item: pytest.Item) -> str:
    """The item's id without the ``@group`` suffix ``--dist loadgroup`` adds to it, so a
    record names a scenario the same way in a serial run and a distributed one."""
    nodeid = item.nodeid
    for mark in item.iter_markers("xdist_group"):
        name = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
        nodeid = nodeid.removesuffix(f"@{name}")
    return nodeid


def payload(
    record: Record,
    *,
    caps: Capabilities | None,
    verdict: bool,
    excuse: bool,
    why: str,
    driver_problem: tuple[str, str] | None,
    patches: list[rig_patches.Application],
    baseline_stale: str,
) -> dict[str, Any]:
    """What a worker sends for one scenario, as plain JSON types (execnet sends nothing
    else; a scenario's notes may hold any value, written as text as ``records.jsonl``
    does)."""
    data = {
        "record": asdict(record),
        "caps": caps.as_dict() if caps is not None else None,
        "verdict": verdict,
        "excuse": excuse,
        "why": why,
        "driver_problem": list(driver_problem) if driver_problem else None,
        "patches": [asdict(a) for a in patches],
        "baseline_stale": baseline_stale,
    }
    return json.loads(json.dumps(data, default=str))


def received(report: pytest.TestReport) -> dict[str, Any] | None:
    """The payload a worker attached to ``report``, if any."""
    data = getattr(report, PAYLOAD_ATTR, None)
    return data if isinstance(data, dict) else None


def apply_patches(state: Any, apps: list[dict[str, Any]], connector: str | None) -> None:
    """Add a worker's rig-patch records to the controller's log (credited to
    ``connector`` when they came with its scenario)."""
    if state.patches is None:
        return
    state.patches.merge([rig_patches.Application(**a) for a in apps], connector)


class Merger:
    """The controller's side: each scenario's payload into the session's state, as the
    serial run records it (registered on the controller only)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = received(report)
        if data is not None:
            merge(self.config.stash[STATE], data)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        apps = getattr(node, "workeroutput", {}).get(PATCHES_KEY, [])
        apply_patches(self.config.stash[STATE], apps, None)


def merge(state: SessionState, data: dict[str, Any]) -> None:
    """One worker's scenario: its record, coverage note, capabilities, driver problem,
    rig patches and baseline entry; then the live report."""
    from kvfail.conformance.hooks import reporting

    rec = Record(**data["record"])
    spec = rec.connector
    if data["caps"] is not None and spec not in state.caps:
        state.caps[spec] = Capabilities.from_dict(data["caps"])
    problem = data["driver_problem"]
    if problem:
        kind, why = problem
        (state.unavailable if kind == "unavailable" else state.broken).setdefault(spec, why)
    apply_patches(state, data["patches"], spec)
    caps = state.caps.get(spec)
    if state.baseline is not None and caps is not None:
        entry = state.baseline.lookup(caps.connector_path, rec.scenario, rec.policy, rec.layout)
        if entry is not None:
            entry.matched = entry.matched or rec.outcome == "xfailed"
            entry.stale = entry.stale or data["baseline_stale"]
    reporting.scenario_ended(
        state, rec, verdict=data["verdict"], excuse=data["excuse"], why=data["why"]
    )
