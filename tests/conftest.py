"""Shared test configuration.

Hypothesis profiles: ``default`` keeps the suite fast; ``slow`` (HYPOTHESIS_PROFILE=slow or
``--hypothesis-profile=slow``) runs the stateful model check with >= 2,000 examples.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvfail.conformance.plugin import drivers_required
from tests import transports
from tests.xdist_groups import group_module_runs

# Mooncake's TransferEngine logs INFO lines (glog) when it is destroyed at interpreter exit,
# after pytest's summary line; keep that line last.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

settings.register_profile(
    "default", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def quiet_kvfail_logs() -> Iterator[None]:
    """Silence kvfail's per-failure log lines for volume tests (captured records grow)."""
    logger = logging.getLogger("kvfail")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # setLevel, not .level=: it clears the level cache
    try:
        yield
    finally:
        logger.setLevel(level)


def pytest_configure(config: pytest.Config) -> None:
    """Record whether this run requires its transports (``tests/transports.py``)."""
    transports.REQUIRED = drivers_required(config)


#: A host name the fixture below makes fail, as a name that stopped resolving does.
UNRESOLVABLE = "kvfail-p-gone.invalid"


@pytest.fixture
def unresolvable_name(monkeypatch: pytest.MonkeyPatch) -> str:
    """:data:`UNRESOLVABLE`, which ``socket.getaddrinfo`` fails with ``EAI_NONAME`` (every
    other name resolves as usual). Why not the real resolver: it would ask this machine's
    DNS server, and tests talk to loopback only. The real path, a name removed from a
    resolver the run owns, is ``tests/peers/test_name_resolution.py``."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        if host == UNRESOLVABLE:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return UNRESOLVABLE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Module-scoped peers and sessions of ``tests/`` run once each under xdist."""
    group_module_runs(items, Path(__file__).parent)
