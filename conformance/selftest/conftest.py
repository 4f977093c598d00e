"""Shared set-up of the suite's self-tests.

``pytester`` unloads every module an inner session imported when it ends, and vLLM (with
torch) cannot be imported a second time in one process: so whatever an inner session
needs is imported, and one toy engine run, before the first ``pytester`` fixture exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.xdist_groups import group_module_runs


@pytest.fixture(scope="module")
def vllm_loaded() -> None:
    """Import vLLM and everything an inner conformance session uses, and run one load."""
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
    from kvfail.harness import Engine, EngineSpec

    with Engine(EngineSpec(extra_config={"toy_mode": "complete"})) as engine:
        engine.add_request("warm", kv_transfer_params={"do_remote_prefill": True})
        assert engine.run_until_idle(max_steps=20, timeout_s=30.0).ok


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This directory's module-scoped inner sessions run once each under xdist."""
    group_module_runs(items, Path(__file__).parent)
