"""Fixtures of the Mooncake D-side unit tests: a fake P and D's worker connector.

Why a conftest: pytest finds them here for every ``test_mooncake_*`` module that drives
the real worker, with no import that would shadow the test's argument. Module scope: each
module gets its own D and P, so no module's loads or holds leak into another's. vLLM and
Mooncake are imported inside the fixtures, so collecting the other connector tests
needs neither; the helpers are :mod:`tests.connectors.mooncake_d_side`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from connectors.mooncake import KvfailMooncakeConnector
    from tests.connectors.fake_mooncake_p import FakePrefill


@pytest.fixture(scope="module")
def fake_mooncake_p() -> Iterator[FakePrefill]:
    """A scripted P on loopback, shared by one module's tests."""
    from tests.connectors.fake_mooncake_p import FakePrefill

    p = FakePrefill()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def mooncake_d(request: pytest.FixtureRequest) -> Iterator[KvfailMooncakeConnector]:
    """D's worker connector, shared by one module's tests: each uses its own ids and
    blocks. Named after the module, so no two modules' D share an engine id."""
    from tests.connectors.mooncake_d_side import build_worker_connector

    conn = build_worker_connector(f"D-{request.module.__name__.rsplit('.', 1)[-1]}")
    try:
        yield conn
    finally:
        conn.shutdown()
