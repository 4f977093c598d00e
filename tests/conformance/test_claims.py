"""The rig is chosen by what a connector does: each driver claims classes by probing what
their constructor builds and reads (``kvfail.conformance.claims``), never by their name,
module or ancestry.

Why: the rig decides which scenarios can run and what P writes, so a rig chosen by
lineage lets a class's family, not its behaviour, shape its verdicts. A subclass under
another name, or an unrelated class doing the same thing, must get the same rig; the same
class named two ways must too; and a class must not choose its own set-up.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the drivers probe vLLM's connector classes")

from kvfail.conformance.claims import choose, probe, split_options
from kvfail.conformance.driver import DriverUnavailable
from kvfail.conformance.resolve import resolve, spec_problem

HERE = "tests.conformance.lookalikes"
V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
#: (registry name, module:Class) of the same class: both must get the same driver.
SAME_CLASS = [
    ("MooncakeConnector", f"{V1}.mooncake.mooncake_connector:MooncakeConnector"),
    ("NixlConnector", f"{V1}.nixl.connector:NixlPullConnector"),
    ("NixlPushConnector", f"{V1}.nixl.connector:NixlPushConnector"),
    ("ExampleConnector", f"{V1}.example_connector:ExampleConnector"),
    ("MultiConnector", f"{V1}.multi_connector:MultiConnector"),
    ("MooncakeStoreConnector", f"{V1}.mooncake.store.connector:MooncakeStoreConnector"),
]


def _class(connector: str, module: str | None) -> type:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if module is None:
        return KVConnectorFactory.get_connector_class_by_name(connector)
    return getattr(importlib.import_module(module), connector)


def _p_class(driver: Any) -> type | None:
    """The class P runs (a pair driver's None: D's own; a store driver's (name, module))."""
    p = getattr(driver, "_p_connector", None)
    if isinstance(p, tuple):
        return _class(*p)
    if p is None:
        return driver.connector_cls if hasattr(driver, "_p_module") else None
    return _class(p, driver._p_module)


def _rig(driver: Any) -> dict[str, object]:
    """What a driver sets up for its connector, whatever its ``--connector`` name."""
    child = getattr(driver, "child", None)
    return {
        "driver": type(driver).__name__,
        "class": driver.connector_cls,
        "p": _p_class(driver),
        "child": None if child is None else _class(*child),
    }


@pytest.mark.parametrize(("registry", "path"), SAME_CLASS)
def test_same_class_gets_same_driver_however_named(registry: str, path: str) -> None:
    """``vllm:<Name>`` (a registered entry point, or a claim) and ``module:Class`` of the
    same class give the same driver class, D class, P and children."""
    by_name, by_path = resolve(f"vllm:{registry}"), resolve(path)
    assert by_name.connector_cls is by_path.connector_cls
    assert _rig(by_name) == _rig(by_path)
    assert by_path.chosen and by_name.chosen


@pytest.mark.parametrize(
    ("subclass", "parent"),
    [
        (f"{HERE}:RenamedMooncake", f"{V1}.mooncake.mooncake_connector:MooncakeConnector"),
        (f"{HERE}:RenamedExample", f"{V1}.example_connector:ExampleConnector"),
    ],
)
def test_renamed_subclass_gets_its_parents_rig(subclass: str, parent: str) -> None:
    child, base = resolve(subclass), resolve(parent)
    assert {k: v for k, v in _rig(child).items() if k != "class"} == {
        k: v for k, v in _rig(base).items() if k != "class"
    }
    assert child.chosen == base.chosen  # the same evidence: what the code builds and reads


@pytest.mark.parametrize(
    ("lookalike", "like"),
    [
        ("PullsOverMooncake", "MooncakeDriver"),
        ("FilesOnDisk", "ExampleDriver"),
        ("ToyLike", "ToyDriver"),
    ],
)
def test_unrelated_class_that_behaves_alike_is_claimed(lookalike: str, like: str) -> None:
    """No common ancestor with the driver's connector: the claim is on behaviour."""
    driver = resolve(f"{HERE}:{lookalike}")
    assert type(driver).__name__ == like, driver.chosen
    assert driver.connector_cls.__name__ == lookalike


@pytest.mark.parametrize(
    "spec",
    [
        f"{HERE}:NoTransport",
        # Reads the store's directory key, but its lookup never looks there: not a store D.
        f"{HERE}:SavesOnly",
        "vllm:ExampleHiddenStatesConnector",
    ],
)
def test_unclaimed_class_gets_the_generic_driver_and_says_so(spec: str) -> None:
    """No claim: the generic driver, which has no P, so it declares no remote prefill
    (every load scenario is a named skip, its clauses left to the coverage gate)."""
    driver = resolve(spec)
    assert type(driver).__name__ == "GenericDriver"
    assert "no driver claims it" in driver.chosen and "generic driver" in driver.chosen
    declared = driver.declared()
    assert declared.remote_prefill.holds is False
    assert declared.remote_prefill.why


def test_two_claims_are_an_error_naming_both() -> None:
    with pytest.raises(ValueError, match="more than one driver") as err:
        resolve(f"{HERE}:TwoTransports")
    assert "ToyDriver" in str(err.value) and "ExampleDriver" in str(err.value)


def test_pull_and_push_are_told_apart_by_what_the_worker_does() -> None:
    pytest.importorskip("nixl", reason="NIXL is not installed")
    pull, push = (
        resolve(f"{V1}.nixl.connector:{c}") for c in ("NixlPullConnector", "NixlPushConnector")
    )
    assert (type(pull).__name__, type(push).__name__) == ("NixlDriver", "NixlPushDriver")
    assert "READs" in pull.chosen and "WRITEs" in push.chosen


def test_store_p_is_the_same_for_every_connector_of_the_store() -> None:
    """The files' writer is the transport's, not D's family: upstream's class, kvfail's
    and a renamed subclass all load what the same P wrote."""
    ps = {
        resolve(spec)._p_connector  # type: ignore[attr-defined]
        for spec in ("vllm:ExampleConnector", "example", f"{HERE}:RenamedExample")
    }
    assert len(ps) == 1, ps


def test_children_come_from_the_user_never_from_the_class() -> None:
    own = resolve(f"{HERE}:PicksItsOwnChildren")
    assert own.child == ("ExampleConnector", None)  # type: ignore[attr-defined]
    given = resolve(
        f"{HERE}:PicksItsOwnChildren?children=connectors.example:KvfailExampleConnector"
    )
    assert given.child == ("KvfailExampleConnector", "connectors.example")  # type: ignore[attr-defined]
    assert "the option" in given.chosen


def test_an_option_the_chosen_driver_does_not_take_is_refused() -> None:
    with pytest.raises(DriverUnavailable, match="not taken by the driver"):
        resolve(f"{HERE}:FilesOnDisk?children=vllm:ExampleConnector")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("vllm:MultiConnector?children=vllm:ExampleConnector", None),
        ("mooncake?children=x", "options follow vllm:<Name> or module:Class"),
        ("a.b:C?children", "is not key=value"),
        ("a.b:C?k=1&k=2", "given twice"),
    ],
)
def test_option_syntax(spec: str, problem: str | None) -> None:
    found = spec_problem(spec)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_probe_reads_what_the_constructor_builds() -> None:
    """The evidence the claims stand on: the worker upstream's Mooncake connector builds
    opens a TransferEngine, and the Example connector reads its directory's key."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )

    assert [c.__name__ for c in probe(MooncakeConnector).builds_from("mooncake")] == [
        "TransferEngine"
    ]
    assert probe(ExampleConnector).reads("shared_storage_path")
    assert (
        choose(probe(ExampleConnector)).claimant == "kvfail.conformance.store_driver:ExampleDriver"
    )
    assert split_options("a:B?x=1&y=2") == ("a:B", {"x": "1", "y": "2"})


def test_a_guard_control_wraps_the_inner_the_user_names() -> None:
    """The inner of a guard class comes from ``?inner=``: the class names none."""
    pytest.importorskip("connectors.guard", reason="the guard is not importable here")
    from kvfail.conformance.guard_negative import GUARD_INNER

    spec = f"kvfail.conformance.guard_negative:FreesAtDeadline?inner={GUARD_INNER}"
    driver: Any = resolve(spec)
    assert type(driver).__name__ == "GuardDriver"
    assert type(driver.inner).__name__ == "MooncakeDriver"
    assert driver.connector_cls.__name__ == "FreesAtDeadline"
    assert f"?inner={GUARD_INNER}" in driver.chosen
    with pytest.raises(DriverUnavailable, match="takes no other option"):
        resolve(f"{spec}&children=vllm:ExampleConnector")
