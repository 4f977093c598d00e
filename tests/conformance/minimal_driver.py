"""A complete, minimal third-party conformance driver: the one ``docs/driver-guide.md``
walks through, and that ``test_minimal_driver.py`` registers and runs.

It drives kvfail's ``ToyConnector`` (an in-process test double whose "transport" is a
dict), because a guide's example must run anywhere in seconds; a driver for a real
connector has the same shape, with a real P behind :meth:`MinimalDriver.add_remote_request`
and real faults behind the injectors of :attr:`MinimalDriver.injectors`. Nothing here
imports a private name of kvfail: only the Driver API (``kvfail.conformance.driver``), the
fault points and the harness's ``EngineSpec``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfail import Stage
from kvfail.conformance.driver import (
    ABORT,
    Claim,
    Declared,
    Driver,
    EngineHandle,
    Injector,
    Provocation,
)
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine


@dataclass
class Delay:
    """A ``net_delay`` fault's state (``Fault.state``): D steps its load has waited."""

    steps: int = 0


class MinimalDriver(Driver[EngineHandle]):
    """``ToyConnector`` on D; P is played in memory, and each load waits for this driver."""

    #: The deadline asked of D's connector in deadline scenarios (``toy_deadline_s``).
    DEADLINE_S = 0.5
    #: D steps a ``net_delay`` load waits before the in-memory P answers.
    DELAY_STEPS = 3

    def __init__(self, name: str) -> None:
        from kvfail.harness.toy import ToyConnector

        self.name = name
        self.connector_cls = ToyConnector

    # -- what this driver can do -------------------------------------------------------

    @property
    def injectors(self) -> dict[FaultPoint, Injector]:
        """The fault table: each fault point this driver can provoke, and how."""
        return {
            # P answers the load with an error.
            FaultPoint.PEER_ERROR_RESPONSE: Injector(provoke=self.p_says_no),
            # P never answers: only D's deadline ends the load, nothing to do.
            FaultPoint.FREEZE_PEER: Injector(),
            # P answers, DELAY_STEPS D steps late: observe() counts them in the state.
            FaultPoint.NET_DELAY: Injector(state=Delay),
            # The request is aborted mid-load (the same for every driver).
            FaultPoint.ABORT_WHILE_WAITING: ABORT,
        }

    def declared(self) -> Declared:
        return Declared(
            async_load=Claim(True, "ToyConnector loads asynchronously"),
            sync_load=Claim(False, "ToyConnector only advertises asynchronous loads"),
            remote_prefill=Claim(True, "an in-memory P answers each load"),
            two_groups=Claim(False, "this example builds one KV-cache group"),
            real_transport=Claim(False, "an in-memory test double"),
            tp2=Claim(False, "this example builds TP 1 only"),
            hetero_tp=Claim(False, "this example builds TP 1 only"),
        )

    # -- D ----------------------------------------------------------------------------

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        from kvfail.harness.config import EngineSpec

        extra: dict[str, object] = {"toy_mode": "hold"}  # every load waits for settle/provoke
        if deadline:
            extra["toy_deadline_s"] = self.DEADLINE_S
        return EngineSpec(
            connector=self.connector_cls.__name__,
            connector_module=self.connector_cls.__module__,
            policy=policy,
            num_kv_cache_groups=num_kv_cache_groups,
            tp_size=tp_size,
            extra_config=extra,
        )

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        # A real driver has P prefill here and passes P's kv_transfer_params on. A fault
        # that must exist before D sees the request is set up now: take_fault hands over
        # the Fault the scenario armed (its state made by the injector's `state`) and its
        # injector.
        self.take_fault(engine, request_id)
        engine.add_request(
            request_id,
            prompt_len=prompt_len,
            prompt_seed=request_id,
            max_tokens=max_tokens,
            kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "P-minimal"},
        )
        return request_id

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        for worker in engine.workers:
            if ranks is None or worker.rank in ranks:
                worker.connector.complete(request_id)

    def p_says_no(self, call: Provocation) -> None:
        """``peer_error_response``'s provoke hook: every rank's load fails."""
        for worker in call.engine.workers:
            worker.connector.fail(call.request_id, stage=Stage.PEER, reason="P said no")

    def observe(self, engine: Engine) -> None:
        """After every D step: a delayed P answers once its load waited long enough."""
        handle = self.handle(engine)
        waiting = engine.waiting_for_remote()
        for request_id, fault in list(handle.active.items()):
            if not isinstance(fault.state, Delay) or request_id not in waiting:
                continue
            fault.state.steps += 1
            if fault.state.steps >= self.DELAY_STEPS:
                del handle.active[request_id]
                self.settle(engine, request_id)


def make_driver(name: str) -> MinimalDriver:
    """What the ``kvfail.drivers`` entry point names: called with the ``--connector`` value."""
    return MinimalDriver(name)
