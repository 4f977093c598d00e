"""NIXL's progress thread on a CPU test rig: a short sleep between polls, not a busy spin.

Why: NIXL's Python API creates every agent with the C++ config field ``pthrDelay``
pinned to 0, so the agent's progress thread polls the transport without pause. That is
the right call on a GPU host, where the thread owns a core. On a small CPU rig every
agent (each P, each D engine, each TP rank) then takes a whole core, idle or not;
starved engines step late, and a deadline check that runs at a drain runs late with them.
With a pause of about 100 µs the thread costs a small fraction of a core, and a transfer
waits at most that long for the thread's next poll (``bench.nixl_progress`` measures both).

The rig opts in with ``KVFAIL_NIXL_PTHR_DELAY_US`` (set in ``kvfail.peers.nixl.NIXL_ENV``
and in the e2e servers' environment; unset or ``0`` keeps NIXL's own behaviour). It sets
that one public field of ``nixlAgentConfig`` as each later agent is created, by wrapping
the binding NIXL's API module creates agents through. That is a patch of the system under
test (the connector's own agents get the delay), so each agent it changes is recorded as
the rig patch ``nixl_progress_delay`` (:mod:`kvfail.rig.patches`), and reports list it.
No vLLM import, and NIXL is imported only when the variable is set.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvfail.rig import patches as rig_patches

__all__ = ["ENV", "apply_from_env", "current_delay_us", "set_progress_delay"]

ENV = "KVFAIL_NIXL_PTHR_DELAY_US"
#: The NIXL API module whose binding was wrapped (``nixl_cu12._api``), once set.
_api_module: str | None = None


class _DelayedAgents:
    """NIXL's binding module as its Python API sees it, except that ``nixlAgent`` gives a
    spinning progress thread (``pthrDelay == 0``) the rig's delay."""

    def __init__(self, binding: Any, delay_us: int) -> None:
        self._binding = binding
        self.delay_us = delay_us

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False) and config.pthrDelay == 0:
            config.pthrDelay = self.delay_us
            rig_patches.record("nixl_progress_delay", f"{self.delay_us} µs")
        return self._binding.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)


def set_progress_delay(delay_us: int) -> bool:
    """Give agents created from now on a ``delay_us`` progress-thread delay; idempotent
    (a second call changes the delay). False when NIXL is not importable here."""
    if delay_us <= 0:
        raise ValueError(f"{ENV}: the delay must be a positive number of µs, got {delay_us}")
    try:
        from nixl._api import nixl_agent
    except Exception:  # ImportError, or a missing native library: no agents to tune
        return False
    global _api_module
    _api_module = nixl_agent.__module__
    api = sys.modules[_api_module]
    binding = api.nixlBind
    if isinstance(binding, _DelayedAgents):
        binding.delay_us = delay_us
    else:
        api.nixlBind = _DelayedAgents(binding, delay_us)
    return True


def current_delay_us() -> int | None:
    """The delay agents created now get in this process (None: NIXL's own busy poll, or
    never set here). Reads state only; imports nothing."""
    module = sys.modules.get(_api_module) if _api_module else None
    binding = getattr(module, "nixlBind", None)
    return binding.delay_us if isinstance(binding, _DelayedAgents) else None


def apply_from_env() -> bool:
    """Apply ``$KVFAIL_NIXL_PTHR_DELAY_US`` if set and positive; True iff now in effect.

    Called where an engine builds its workers (the harness, a TP rank process, an e2e
    server), before any agent exists. A value that is not an integer is an error."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return False
    try:
        delay = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer number of µs, got {raw!r}") from None
    return set_progress_delay(delay) if delay > 0 else False
