"""The coverage gate's rules, on the ledger alone: which skips excuse a clause, and which
clauses end a run unjudged."""

from __future__ import annotations

from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.hooks.coverage import Ledger, excused, genuine

ASYNC = Capabilities(connector="X", driver="d", async_load=True, remote_prefill=True)
NEITHER = Capabilities(connector="X", driver="d", remote_prefill=True)


def test_only_optional_capabilities_excuse_a_clause() -> None:
    assert excused(("tp2",), ASYNC) and excused(("fault",), ASYNC) and excused(("layout",), ASYNC)
    assert excused(("sync_load",), ASYNC)  # it loads the other way
    assert not excused(("sync_load",), NEITHER)  # a connector loads one way or the other
    assert not excused(("async_load",), NEITHER)
    assert not excused(("remote_prefill",), ASYNC)  # nothing can feed it: nothing is judged
    assert not excused(("driver",), ASYNC)


def test_a_suite_skip_must_name_what_is_really_missing() -> None:
    assert genuine(("tp2",), ASYNC)
    assert not genuine(("async_load",), ASYNC)  # it has it: a forged skip
    assert not genuine(("made_up",), ASYNC)
    assert not genuine((), ASYNC)
    assert genuine(("fault",), ASYNC) and genuine(("driver",), None)


def test_a_clause_needs_one_scenario_run_to_completion() -> None:
    ledger = Ledger()
    ledger.note("x", "test_load", ["C1", "C2"], verdict=False, excuse=False, why="skipped (a)")
    ledger.note("x", "test_tp2", ["C6"], verdict=False, excuse=True, why="skipped (tp2)")
    ledger.note("x", "test_local", ["C7"], verdict=True, excuse=False, why="passed")
    ledger.note("x", "test_other", ["C2"], verdict=True, excuse=False, why="failed")
    assert ledger.unverified() == ["C1 unverified for x: test_load: skipped (a)"]
    assert ledger.as_dict() == {
        "x": {"C1": "unverified", "C2": "verified", "C6": "excused", "C7": "verified"}
    }
