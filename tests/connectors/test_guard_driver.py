"""``--connector guard:X``: the prefix resolves to X's own driver, and only D's spec is
rewritten (P stays X's P; X's extra config travels whole; a requested deadline becomes the
guard's)."""

from __future__ import annotations

import pytest

from kvfail.conformance.guard_driver import guard_spec
from kvfail.conformance.resolve import spec_problem
from kvfail.deadline import DEADLINE_KEY

harness_config = pytest.importorskip("kvfail.harness.config")


@pytest.mark.parametrize(
    "spec", ["guard:vllm:MooncakeConnector", "guard:some.module:Class", "guard:guard:vllm:X"]
)
def test_guard_prefix_is_accepted_wherever_its_inner_is(spec: str) -> None:
    assert spec_problem(spec) is None


@pytest.mark.parametrize(
    ("spec", "says"), [("guard:", "no connector after"), ("guard:x", "unknown")]
)
def test_guard_prefix_without_a_usable_inner_is_a_usage_error(spec: str, says: str) -> None:
    problem = spec_problem(spec)
    assert problem is not None and says in problem and "guard:" in problem


def test_only_a_consumer_is_wrapped_with_its_own_extra_config() -> None:
    spec_cls = harness_config.EngineSpec
    extra = {"mooncake_protocol": "tcp", DEADLINE_KEY: 3.0}
    d = spec_cls(connector="MooncakeConnector", connector_module=None, extra_config=extra)
    wrapped = guard_spec(d)
    assert (wrapped.connector, wrapped.connector_module) == (
        "KvfailGuardConnector",
        "connectors.guard",
    )
    assert dict(wrapped.extra_config) == {
        "inner": "MooncakeConnector",
        "inner_extra_config": extra,
        "deadline_s": 3.0,
    }
    assert (wrapped.policy, wrapped.num_blocks, wrapped.engine_id) == (
        d.policy,
        d.num_blocks,
        d.engine_id,
    )
    assert guard_spec(wrapped) == wrapped  # never wrapped twice
    p = spec_cls(role="producer", connector="MooncakeConnector", connector_module=None)
    assert guard_spec(p) is p


def test_a_class_by_module_path_is_named_by_it_and_no_deadline_means_the_default() -> None:
    d = harness_config.EngineSpec(connector="ToyConnector", connector_module="kvfail.harness.toy")
    extra = dict(guard_spec(d).extra_config)
    assert extra == {"inner": "kvfail.harness.toy:ToyConnector", "inner_extra_config": {}}


def test_a_scenario_deadline_reaches_the_guard_when_the_driver_sets_none() -> None:
    """A store driver puts no deadline into X's config (X has none): the deadline the
    scenario asked for becomes the guard's; one X's config carries wins."""
    d = harness_config.EngineSpec(connector="ExampleConnector", connector_module=None)
    assert dict(guard_spec(d, deadline_s=3.0).extra_config)["deadline_s"] == 3.0
    own = harness_config.EngineSpec(
        connector="MooncakeConnector", connector_module=None, extra_config={DEADLINE_KEY: 5.0}
    )
    assert dict(guard_spec(own, deadline_s=3.0).extra_config)["deadline_s"] == 5.0
