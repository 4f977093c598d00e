"""The Driver API a newcomer has to hold: six required members, abilities read from what a
driver implements, and the suite's own clean-up.

Why: the API is what every third-party driver is written against. What it requires must
stay small and say so in one place (``REQUIRED_MEMBERS``); an ability must not be a flag
that can disagree with the methods behind it; and a clean-up every driver had to remember
is one some driver forgets.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.driver import (
    REQUIRED_MEMBERS,
    ByteOracle,
    Claim,
    Declared,
    Driver,
    Injector,
    declared_capabilities,
)
from kvfail.conformance.suite import ScenarioContext
from kvfail.faults.points import FaultPoint
from tests.conformance.minimal_driver import MinimalDriver


def _required(cls: type) -> set[str]:
    """Abstract members, and attributes annotated on the class without a value."""
    annotated = {
        name
        for name, kind in inspect.get_annotations(cls).items()
        if name not in vars(cls) and "ClassVar" not in str(kind)
    }
    return set(getattr(cls, "__abstractmethods__", ())) | annotated


def test_the_base_requires_six_members_and_says_which() -> None:
    assert _required(Driver) == set(REQUIRED_MEMBERS)
    assert len(REQUIRED_MEMBERS) <= 6


def test_the_example_driver_defines_exactly_what_is_required_and_its_abilities() -> None:
    driver = MinimalDriver("minimal")
    caps = driver.capabilities()
    assert not caps.byte_verification and not caps.malformed_params
    assert caps.reasons["byte_verification"] == "driver MinimalDriver does not implement ByteOracle"
    assert caps.faults == frozenset(driver.injectors)


class _Bytes(MinimalDriver):
    def verify_bytes(self, engine: Any, request_id: str) -> str | None:
        return None

    def wrong_bytes_finding(self, engine: Any, request_id: str) -> str | None:
        return None


def test_an_ability_is_what_the_driver_implements() -> None:
    driver = _Bytes("bytes")
    assert isinstance(driver, ByteOracle)
    caps = driver.capabilities()
    assert caps.byte_verification
    assert caps.reasons["byte_verification"] == "driver _Bytes implements ByteOracle"


class _SlowWithoutLateWrites(MinimalDriver):
    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        return {**super().injectors, FaultPoint.SLOW_PEER_PAST_DEADLINE: Injector()}


def test_a_fault_whose_scenario_needs_an_ability_requires_it() -> None:
    with pytest.raises(TypeError, match=r"slow_peer_past_deadline .* LateWrites"):
        _SlowWithoutLateWrites("slow").capabilities()


class _OldDeclared(MinimalDriver):
    def declared(self) -> Any:
        return {**super().declared().claims(), "byte_verification": (False, "old")}


class _LyingDeclared(MinimalDriver):
    def declared(self) -> Any:
        return {**super().declared().claims(), "byte_verification": (True, "trust me")}


def test_a_declared_dict_still_loads_and_must_agree_with_the_class() -> None:
    with pytest.warns(DeprecationWarning, match="returning a dict"):
        caps = _OldDeclared("old").capabilities()
    assert caps.async_load and not caps.byte_verification
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="byte_verification=True, but driver"):
            declared_capabilities(_LyingDeclared("liar"))


def test_a_claim_left_out_is_an_error_where_the_driver_builds_it() -> None:
    with pytest.raises(TypeError):
        Declared(async_load=Claim(True, "x"))  # type: ignore[call-arg]


class _Recording(MinimalDriver):
    def __init__(self) -> None:
        super().__init__("recording")
        self.calls: list[str] = []

    def forget_engines(self) -> None:
        self.calls.append("forget_engines")
        super().forget_engines()

    def after_scenario(self) -> None:
        self.calls.append(f"after_scenario with {len(self.handles())} handles")

    def before_close(self) -> None:
        self.calls.append("before_close")


def test_the_suite_drops_the_handles_before_the_drivers_repair() -> None:
    driver = _Recording()
    caps = Capabilities(connector="ToyConnector", driver="recording")
    ctx = ScenarioContext(driver=driver, caps=caps, policy="fail", scenario="test_x")
    ctx.close()
    assert driver.calls == ["forget_engines", "after_scenario with 0 handles"]


class _ClosingEngine:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def close(self) -> None:
        self.calls.append("engine closed")


def test_the_driver_may_restore_its_services_before_the_engines_close() -> None:
    """``before_close`` comes after the verdict and before the engines' shutdown (which
    may talk to a service a fault killed), then the handles go and the driver repairs."""
    driver = _Recording()
    caps = Capabilities(connector="ToyConnector", driver="recording")
    ctx = ScenarioContext(driver=driver, caps=caps, policy="fail", scenario="test_x")
    ctx.engines.append(_ClosingEngine(driver.calls))  # type: ignore[arg-type]
    ctx.close()
    assert driver.calls == [
        "before_close",
        "engine closed",
        "forget_engines",
        "after_scenario with 0 handles",
    ]


def test_a_driver_written_before_the_fault_table_still_loads() -> None:
    """Its ``faults`` list is its table, its own ``provoke`` still acts, its dict
    ``declared()`` still loads: each with a deprecation warning."""
    provoked: list[FaultPoint] = []
    with pytest.warns(DeprecationWarning, match="faults is deprecated"):

        class Old(Driver):  # type: ignore[type-arg]
            name = "old"
            connector_cls = object

            @property
            def faults(self) -> frozenset[FaultPoint]:
                return frozenset({FaultPoint.REFUSE})

            def declared(self) -> Any:
                return {"async_load": (True, "old"), "remote_prefill": (True, "old")}

            def engine_spec(self, *args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError

            def add_remote_request(self, *args: Any, **kwargs: Any) -> str:
                raise NotImplementedError

            def provoke(self, engine: Any, request_id: str, point: FaultPoint, **kw: Any) -> None:
                provoked.append(point)

    driver = Old()
    assert set(driver.injectors) == {FaultPoint.REFUSE}
    driver.provoke(None, "r1", FaultPoint.REFUSE)
    assert provoked == [FaultPoint.REFUSE]
    with pytest.warns(DeprecationWarning, match="returning a dict"):
        caps = declared_capabilities(driver)
    assert caps["async_load"] == (True, "old")
