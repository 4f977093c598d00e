"""A closed Mooncake D engine leaves nothing behind in its process.

Why: upstream's worker only stops its receiver loop at shutdown. A task still pending
there (the per-P handler every pull starts) then stays pending forever, and anyio's
registry of task states keeps it, the worker, its TransferEngine and their sockets alive.
A process that builds and drops D engines (the suite, a router's test rig) grew by about
nine descriptors per engine until a descriptor numbered past 1024 broke ``select``.
Real P process, real TransferEngine over loopback TCP, vLLM's real scheduler.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from kvfail.conformance.mooncake_driver import MooncakeDriver  # noqa: E402
from kvfail.conformance.suite import ScenarioContext  # noqa: E402

pytestmark = pytest.mark.vllm

#: Engines built and closed after the first, each with one load from P.
ENGINES = 3


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _close_mid_load(driver: MooncakeDriver, stem: str, *, finish: bool) -> weakref.ref[object]:
    """A fresh D engine starts a load from P; when ``finish``, the load completes and
    the suite's oracles judge it, else the engine is closed with the load still in flight
    (a scenario that fails, a process that drops an engine). A weak reference to its
    worker."""
    ctx = ScenarioContext(
        driver=driver, caps=driver.capabilities(), policy="recompute", scenario="teardown"
    )
    try:
        engine = ctx.engine()
        worker = engine.workers[0].connector.connector_worker
        request_id = ctx.rid(stem)
        ctx.add_loading(engine, request_id)
        if finish:
            driver.settle(engine, request_id)
            ctx.run(engine)
            assert ctx.violations(engine, [request_id], failed=False) == []
    finally:
        ctx.close()
    assert worker.receiver_loop.is_closed()
    return weakref.ref(worker)


@pytest.mark.parametrize("finish", [True, False], ids=["after-the-load", "mid-load"])
def test_closed_d_engines_free_their_worker_and_descriptors(finish: bool) -> None:
    driver = MooncakeDriver()
    driver.start()
    try:
        _close_mid_load(driver, "teardown-first", finish=True)  # warms shared state
        gc.collect()
        before = _descriptors()
        workers = [_close_mid_load(driver, "teardown", finish=finish) for _ in range(ENGINES)]
        gc.collect()
        assert [w() for w in workers] == [None] * ENGINES
        assert _descriptors() <= before
    finally:
        driver.stop()
