"""Shared test configuration.

Hypothesis profiles: ``default`` keeps the suite fast; ``slow`` (HYPOTHESIS_PROFILE=slow or
``--hypothesis-profile=slow``) runs the stateful model check with >= 2,000 examples.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from kvfail.conformance.plugin import drivers_required
from tests import transports

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
