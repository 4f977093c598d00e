"""Store-connector scenarios: what a store advertised is gone or damaged when D loads it.

A store connector (one that finds KV by key on disk or in a store and loads it itself)
has faults a P/D pair has not: the entry it matched can be gone, cut short, corrupt, a
directory, or hold someone else's bytes by the time it is read; a store served by
processes (a master, the owner of the memory the blocks live in) can lose them between
D's lookup and D's load. Each scenario provokes one fault point of the driver and ends
with every harness oracle plus the integrity oracle. Requirements are capabilities (a
remote-prefill driver advertising the fault), never connector names.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.report_timing import deadline_findings
from kvfail.conformance.suite import ScenarioContext
from kvfail.faults.points import FaultPoint

pytestmark = pytest.mark.vllm

#: Damage a connector can notice when it reads the file: it must report, not raise.
UNREADABLE = (
    FaultPoint.STORE_FILE_DELETED,
    FaultPoint.STORE_FILE_TRUNCATED,
    FaultPoint.STORE_GARBAGE_HEADER,
    FaultPoint.STORE_REPLACED_BY_DIR,
)


def _add(scenario: ScenarioContext, stem: str) -> tuple[Any, str]:
    scenario.require("remote_prefill", "sync_load")
    engine = scenario.engine()
    rid = scenario.rid(stem)
    scenario.driver.add_remote_request(engine, rid)
    return engine, rid


@pytest.mark.clauses("C1", "C4")
@pytest.mark.guards("ExampleConnector store")
def test_store_load_ok(scenario: ScenarioContext) -> None:
    """The baseline: what P stored loads into D, byte for byte, and all is freed."""
    engine, rid = _add_any(scenario, "store-ok")
    scenario.run(engine)
    scenario.check(engine, [rid], failed=False)


@pytest.mark.clauses("C1", "C4", "C13")
@pytest.mark.guards("ExampleConnector store", "#40364")
@pytest.mark.parametrize("point", UNREADABLE, ids=[p.value for p in UNREADABLE])
def test_store_file_unreadable(scenario: ScenarioContext, point: FaultPoint) -> None:
    """A file the connector matched cannot be read: the load is reported failed in the
    pass that read it (C4), never raised out of start_load_kv (C13)."""
    scenario.require_fault(point)
    engine, rid = _add(scenario, "store-bad")
    scenario.driver.provoke(engine, rid, point)
    scenario.run(engine)
    scenario.check(engine, [rid], failed=True)


@pytest.mark.clauses("C1")
@pytest.mark.guards("ExampleConnector store", "HF3FS", "LMCache#4600")
def test_store_data_overwritten(scenario: ScenarioContext) -> None:
    """The file parses but holds other bytes: a connector without a checksum reports
    success, and D runs on KV that is not P's. Only the integrity oracle sees it."""
    scenario.require_fault(FaultPoint.STORE_DATA_OVERWRITTEN)
    engine, rid = _add(scenario, "store-overwritten")
    scenario.driver.provoke(engine, rid, FaultPoint.STORE_DATA_OVERWRITTEN)
    scenario.run(engine)
    scenario.check(engine, [rid], failed=None)


@pytest.mark.clauses("C1", "C8")
@pytest.mark.guards("MultiConnector")
def test_store_bystander_damaged(scenario: ScenarioContext) -> None:
    """A composite connector loads from the child that matched first; another child (a
    bystander) holds other bytes for the same prompt. The load must succeed on P's
    bytes: a bystander is never read, and never makes the load fail."""
    scenario.require_fault(FaultPoint.STORE_BYSTANDER_DAMAGED)
    engine, rid = _add(scenario, "store-bystander")
    scenario.driver.provoke(engine, rid, FaultPoint.STORE_BYSTANDER_DAMAGED)
    scenario.run(engine)
    scenario.check(engine, [rid], failed=False)


@pytest.mark.clauses("C1", "C4", "C13")
@pytest.mark.guards("MultiConnector")
def test_store_all_children_damaged(scenario: ScenarioContext) -> None:
    """Every child of a composite connector lost the entry its lookup matched: the load
    is reported failed (C1, C4), never raised out of a child into the worker (C13)."""
    scenario.require_fault(FaultPoint.STORE_ALL_CHILDREN_DAMAGED)
    engine, rid = _add(scenario, "store-all-children")
    scenario.driver.provoke(engine, rid, FaultPoint.STORE_ALL_CHILDREN_DAMAGED)
    scenario.run(engine)
    scenario.check(engine, [rid], failed=True)


#: Faults on a store's processes or keys between D's lookup and D's load that the
#: connector sees at once (an error from the store): reported failed, promptly.
STORE_LOST = (
    FaultPoint.STORE_MASTER_KILLED,
    FaultPoint.STORE_MASTER_RESTARTED,
    FaultPoint.STORE_KEY_REMOVED,
    FaultPoint.STORE_KEY_EVICTED,
    FaultPoint.STORE_SEGMENT_OWNER_KILLED,
)


#: Every store fault point: a driver advertising one of them serves a store connector.
STORE_POINTS = tuple(p for p in FaultPoint if p.value.startswith("store_"))


def _add_any(scenario: ScenarioContext, stem: str, **engine: Any) -> tuple[Any, str]:
    """A D and a request whose prefix the store holds, for a sync or an async loader."""
    scenario.require("remote_prefill")
    scenario.require_fault(*STORE_POINTS)
    scenario.require_any("sync_load", "async_load")
    d = scenario.engine(**engine)
    rid = scenario.rid(stem)
    scenario.driver.add_remote_request(d, rid)
    return d, rid


@pytest.mark.clauses("C1", "C2", "C10", "C13")
@pytest.mark.guards("MooncakeStore", "#50719")
@pytest.mark.parametrize("point", STORE_LOST, ids=[p.value for p in STORE_LOST])
def test_store_lost_after_lookup(scenario: ScenarioContext, point: FaultPoint) -> None:
    """The store matched the prefix, then lost it (its master killed or restarted empty,
    the keys removed or one of them evicted, the memory's owner killed) before D read it:
    the load is reported failed, never raised, never run on as if loaded."""
    scenario.require_fault(point)
    engine, rid = _add_any(scenario, f"store-{point.value}")
    scenario.driver.provoke(engine, rid, point)
    scenario.run(engine)
    scenario.check(engine, [rid], failed=True)


@pytest.mark.clauses("C1", "C2", "C10")
@pytest.mark.guards("MooncakeStore", "#35943")
def test_store_master_frozen(scenario: ScenarioContext) -> None:
    """The store's master stops answering (SIGSTOP) after D's lookup matched: its sockets
    accept, nothing answers. Only a deadline of D's connector can end the load (C10);
    the suite waits its bounded wait for the one it declares."""
    scenario.require_fault(FaultPoint.STORE_MASTER_FROZEN)
    engine, rid = _add_any(scenario, "store-master-frozen", deadline=True)
    deadline = scenario.declared_deadline_s(engine)
    scenario.driver.provoke(engine, rid, FaultPoint.STORE_MASTER_FROZEN)
    budget = scenario.deadline_budget(deadline)
    scenario.wait_floor(budget if deadline is None else deadline)
    scenario.run(engine, timeout_s=budget)
    stranded = [rid] if rid in engine.waiting_for_remote() else []
    # The master resumes before the oracles: what they judge is what was seen above, and
    # D's teardown must not wait on a stopped master.
    scenario.driver.end_faults(engine)
    extra = deadline_findings([rid], stranded, [], deadline, budget)
    scenario.check(engine, [rid], failed=True, extra=extra)
