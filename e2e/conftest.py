"""The end-to-end tier: real ``vllm serve`` P and D servers on CPU, a real proxy and client.

Why a separate tier: each server takes minutes to start on a small machine and gigabytes of
RAM, so these tests stay out of the default run (``testpaths`` does not list ``e2e/``).
Run them with ``.venv/bin/python -m pytest e2e -m e2e``. The marker is registered here, so
``--strict-markers`` needs no pyproject change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfail.rig import shm
from kvfail.rig.processes import live_peers

#: Filled by the tests with what the client saw, timings and metrics; printed at the end.
SUMMARY: dict[str, Any] = {}


#: The quick subset (marker ``e2e_ci``; CI's subset while the whole tier was too slow): one
#: deployment (NIXL: P + a ``fail`` D + a ``recompute`` D, started together), every fault
#: that needs no second P start.
#: Left out: ``test_restart_p`` (a fourth server start, the dearest step) and every
#: Mooncake test (a second deployment).
CI_CONNECTOR = "nixl"
CI_TESTS = frozenset(
    {
        "test_listeners_loopback_only",
        "test_stack_dumps_reach_every_server_process",
        "test_pd_matches_local_and_is_deterministic",
        "test_freeze_p_mid_run",
        "test_kill_p_mid_run",
        "test_failure_counters_by_stage",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: real vllm serve P/D on CPU (minutes per server); run with -m e2e"
    )
    config.addinivalue_line(
        "markers", "e2e_ci: quick e2e subset (NIXL, no P restart); run with -m e2e_ci"
    )
    config.addinivalue_line(
        "markers",
        "e2e_bench: bench smoke runs (real servers, not in -m e2e); run with -m e2e_bench",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the CI subset. Done here, not with marks on the tests, because the subset is
    an intersection (these tests *and* the NIXL deployment), which marks on a test and on
    a fixture parameter cannot express: they would add up."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        connector = callspec.params.get("dep") if callspec is not None else None
        if connector == CI_CONNECTOR and getattr(item, "originalname", item.name) in CI_TESTS:
            item.add_marker(pytest.mark.e2e_ci)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.write_sep("-", "e2e summary")
        terminalreporter.write_line(json.dumps(SUMMARY, indent=1, default=str))


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def model_dir(e2e_dir: Path) -> str:
    """The random-weight checkpoint, generated in a subprocess (offline, seeded, ~5 s)."""
    out = e2e_dir / "model"
    subprocess.run(
        [sys.executable, "-m", "e2e.model", str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
    )
    return str(out)


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_peers() -> Iterator[None]:
    """Every server must be closed by its own fixture; anything left is a leak, closed here.
    Then the shared-memory segments of servers that were SIGKILLed (vLLM's message queues;
    a killed process cannot unlink them) are removed: those created during the session
    that no live process uses."""
    before = shm.segment_names()
    yield
    left = live_peers()
    for peer in left:
        peer.close()
    shm.release_orphans(before, wait_s=shm.EXIT_WAIT_S)
    assert not left, f"servers left running: {left}"


@pytest.fixture(scope="session")
def summary(e2e_dir: Path) -> Iterator[dict[str, Any]]:
    yield SUMMARY
    (e2e_dir / "summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))
