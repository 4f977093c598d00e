"""Shared fixtures for the harness tests.

vLLM's import (~15 s) and the first ``VllmConfig`` of a process (15-60 s) dominate the
run, so they are paid once per session; each test then builds its own cheap ``Engine``
(~50 ms) so no scheduler state leaks between tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def harness() -> Any:
    """``kvfail.harness``, with the process's first config already built."""
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")
    import kvfail.harness as harness

    harness.build_config(harness.EngineSpec())
    return harness


@pytest.fixture
def make_engine(harness: Any) -> Iterator[Callable[..., Any]]:
    """``make_engine(forward=None, worker_build="direct", **spec_fields)``; closed after."""
    engines: list[Any] = []

    def make(*, forward: Any = None, worker_build: str = "direct", **fields: Any) -> Any:
        engine = harness.Engine(
            harness.EngineSpec(**fields), forward=forward, worker_build=worker_build
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
