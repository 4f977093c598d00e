"""One gate for test modules that need a real transport (Mooncake TCP, NIXL/UCX).

Where a transport is absent the module is skipped, except where the run requires its
transports (``--kvfail-require-drivers`` or the ini ``kvfail_require_drivers``, set in this
project's ``pyproject.toml``): there the module fails to collect, so a broken set-up in CI
is a failure and never a quiet skip. ``tests/conftest.py`` records the switch at configure.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import pytest

#: Set from the run's configuration by ``tests/conftest.py`` (``pytest_configure``).
REQUIRED = False


def _probe(transport: Literal["mooncake", "nixl"]) -> Callable[[], str | None]:
    if transport == "mooncake":
        from kvfail.peers.mooncake import mooncake_available

        return mooncake_available
    from kvfail.peers.nixl import nixl_available

    return nixl_available


def require_transport(transport: Literal["mooncake", "nixl"]) -> None:
    """Call at module level: skip (or, where transports are required, fail) the module
    unless vLLM and ``transport`` are both usable here."""
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
    reason = _probe(transport)()
    if reason is None:
        return
    if REQUIRED:
        pytest.fail(f"{transport} is required by this run but absent: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_netns() -> None:
    """Call at module level: the same policy for simulated hosts (network namespaces,
    which need root and iproute2; CI runs as root)."""
    from kvfail.faults.netns import netns_unavailable

    reason = netns_unavailable()
    if reason is None:
        return
    if REQUIRED:
        pytest.fail(f"simulated hosts are required by this run but absent: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def nixl_child_env(side_channel_port: int, **overrides: str) -> dict[str, str]:
    """This process's environment plus what a child that builds a real NIXL worker needs:
    no model downloads, UCX over TCP on loopback, and the side channel on
    ``side_channel_port``. Tests that drive a worker in a fresh process share it, so
    the transport set-up they run under cannot drift apart."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        UCX_TLS="tcp,self",
        UCX_NET_DEVICES="lo",
        NIXL_LOG_LEVEL="WARN",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port),
        **overrides,
    )
