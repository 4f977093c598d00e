"""A fault on one TP rank: the rank is the fault's, and what a driver cannot do it declares.

Why: the one-rank scenarios fault each rank in turn. A driver that cannot fault a rank
alone (Mooncake's P rank 0 also runs the bootstrap every cold D asks) must say so in its
fault table, so the suite picks another fault for that rank, or skips it naming the
driver's reason; never from the driver's class. The rank the scenario names must reach
the driver where it sets the fault up (before D adds the request), not only at provoke.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from kvfail.conformance.capabilities import Capabilities, CapabilityMissing
from kvfail.conformance.driver import Injector
from kvfail.conformance.suite import ScenarioContext, SuiteSkip
from kvfail.faults.points import FaultPoint
from tests.conformance.minimal_driver import MinimalDriver

WHY = "rank 0 also serves the others' bootstrap"


class _OneRank(MinimalDriver):
    """Kills any rank of a warm D's P, but rank 0 of a cold D's only with the others."""

    warm = True

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        table = {
            **super().injectors,
            FaultPoint.TP_ONE_RANK: Injector(not_alone={0: WHY}),
        }
        if self.warm:
            table[FaultPoint.TP_ONE_RANK_WARM] = Injector()
        return table


class _ColdOnly(_OneRank):
    warm = False


CANDIDATES = (FaultPoint.TP_ONE_RANK, FaultPoint.TP_ONE_RANK_WARM)


def test_a_rank_the_fault_cannot_hit_alone_gets_the_next_fault() -> None:
    caps = _OneRank("one-rank").capabilities()
    assert caps.rank_limits == {FaultPoint.TP_ONE_RANK: {0: WHY}}
    assert caps.require_fault_on_rank(1, *CANDIDATES) is FaultPoint.TP_ONE_RANK
    assert caps.require_fault_on_rank(0, *CANDIDATES) is FaultPoint.TP_ONE_RANK_WARM


def test_a_rank_no_fault_can_hit_alone_is_skipped_with_the_drivers_reason() -> None:
    driver = _ColdOnly("cold-only")
    caps = driver.capabilities()
    with pytest.raises(CapabilityMissing, match="tp_one_rank: rank 0 also serves"):
        caps.require_fault_on_rank(0, *CANDIDATES)
    ctx = ScenarioContext(driver=driver, caps=caps, policy="fail", scenario="test_x")
    with pytest.raises(SuiteSkip) as skip:
        ctx.require_fault_on_rank(0, *CANDIDATES)
    assert skip.value.needs == ("fault",)
    assert "tp_one_rank_warm: not advertised" in str(skip.value)
    assert ctx.require_fault_on_rank(1, *CANDIDATES) is FaultPoint.TP_ONE_RANK


def test_the_rank_limits_survive_the_report() -> None:
    caps = _OneRank("one-rank").capabilities()
    back = Capabilities.from_dict(caps.as_dict())
    assert back.rank_limits == caps.rank_limits
    assert back.require_fault_on_rank(0, *CANDIDATES) is FaultPoint.TP_ONE_RANK_WARM


class _Arming(MinimalDriver):
    """Records the faults it takes when a request is added."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.taken: list[tuple[str, Any]] = []

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        return {**super().injectors, FaultPoint.TP_ONE_RANK: Injector()}

    def add_remote_request(
        self, engine: Any, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        taken = self.take_fault(engine, request_id)
        self.taken.append((request_id, None if taken is None else taken[0].ranks))
        return request_id


class _Engine:
    """Only a key for the driver's handle: nothing is stepped."""


def test_the_rank_reaches_the_driver_when_the_request_is_added() -> None:
    driver = _Arming("arming")
    engine = _Engine()
    driver.add_remote_requests(engine, ["a", "b"], fault=FaultPoint.TP_ONE_RANK, ranks=[1])  # type: ignore[arg-type]
    driver.arm(engine, "c", FaultPoint.TP_ONE_RANK)  # type: ignore[arg-type]
    driver.add_remote_request(engine, "c")  # type: ignore[arg-type]
    assert driver.taken == [("a", (1,)), ("b", (1,)), ("c", None)]
