"""``kvfail.rig.nixl_progress``: the rig's progress-thread delay reaches a real NIXL agent.

What is asserted is the config that reaches NIXL's binding (a spy between our wrapper
and the real binding; the agent is then really created), not a CPU figure: that is
``bench/nixl_progress.py``'s job (a ratio against the busy spin, in one run).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from kvfail.rig import nixl_progress
from kvfail.rig.nixl_progress import ENV, apply_from_env, set_progress_delay


def test_unset_or_zero_leaves_nixl_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert apply_from_env() is False
    monkeypatch.setenv(ENV, "0")
    assert apply_from_env() is False


def test_bad_values_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        apply_from_env()
    with pytest.raises(ValueError, match="positive"):
        set_progress_delay(-5)


class _Spy:
    """Stands between our wrapper and NIXL's real binding: records each agent's config."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.seen: list[tuple[bool, int]] = []

    def nixlAgent(self, name: str, config: Any) -> Any:
        self.seen.append((bool(config.useProgThread), int(config.pthrDelay)))
        return self._real.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def nixl_api(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Spy]:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    agent_mod = pytest.importorskip("nixl._api", reason="nixl is not installed")
    api = sys.modules[agent_mod.nixl_agent.__module__]
    real = api.nixlBind
    while isinstance(real, nixl_progress._DelayedAgents):  # a wrapper from another test
        real = real._binding
    spy = _Spy(real)
    monkeypatch.setattr(api, "nixlBind", spy)  # restored after the test
    return agent_mod, spy


def test_a_real_agent_is_created_with_the_delay(
    monkeypatch: pytest.MonkeyPatch, nixl_api: tuple[Any, _Spy]
) -> None:
    agent_mod, spy = nixl_api
    monkeypatch.setenv(ENV, "250")
    assert apply_from_env() is True
    assert nixl_progress.current_delay_us() == 250
    agent = agent_mod.nixl_agent("kvfail-delay", agent_mod.nixl_agent_config())
    assert agent.name == "kvfail-delay"
    assert spy.seen == [(True, 250)]
    assert set_progress_delay(300) is True  # idempotent: one wrapper, new delay
    agent_mod.nixl_agent("kvfail-delay-2", agent_mod.nixl_agent_config())
    assert spy.seen[-1] == (True, 300)


def test_an_agent_without_a_progress_thread_is_left_as_is(
    monkeypatch: pytest.MonkeyPatch, nixl_api: tuple[Any, _Spy]
) -> None:
    agent_mod, spy = nixl_api
    assert set_progress_delay(100) is True
    agent_mod.nixl_agent("kvfail-noprog", agent_mod.nixl_agent_config(enable_prog_thread=False))
    assert spy.seen == [(False, 0)]


def test_the_rig_p_reports_the_delay_its_agents_got() -> None:
    """End to end: NIXL_ENV's setting reaches the agent a real NIXL P process creates."""
    from kvfail.peers.nixl import NIXL_ENV, NixlProducerHandle, nixl_available

    if (why := nixl_available()) is not None:
        pytest.skip(why)
    p = NixlProducerHandle()
    try:
        ready = p.wait_ready(timeout_s=240.0)
        assert ready["nixl_pthr_delay_us"] == int(NIXL_ENV[ENV]) > 0
    finally:
        p.close()
