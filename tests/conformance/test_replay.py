"""A soak replays from its seed: request ids (and so prompts, which derive from the id)
depend only on ``--kvfail-seed`` and the scenario run, never on what ran before; a failing
soak prints the command that replays it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_pytest import child_env, run_child_pytest

#: Request ids of one scenario run after ``warm`` unrelated ones, in a fresh process.
IDS = """
import sys

from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.layout import DEFAULT_LAYOUT
from kvfail.conformance.suite import ScenarioContext

seed, warm = int(sys.argv[1]), int(sys.argv[2])
caps = Capabilities(connector="X", driver="d", connector_path="pkg:X")


def ctx(scenario):
    return ScenarioContext(driver=None, caps=caps, policy="fail", scenario=scenario,
                           layout=DEFAULT_LAYOUT, seed=seed)


for n in range(warm):
    ctx(f"test_other_{n}").rid("x")
soak = ctx("test_soak_random_faults")
print(" ".join(soak.rid("soak") for _ in range(3)))
print(ctx("test_soak_random_faults").rid("soak"))
"""


def _ids(seed: int, warm: int) -> list[str]:
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", IDS, str(seed), str(warm)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.split("\n")[:2]


def test_request_ids_replay_from_the_seed_and_stay_unique() -> None:
    first, again = _ids(7, 0)
    # Other scenarios before it (a full run, against -k soak) change nothing.
    assert _ids(7, 5) == [first, again]
    assert _ids(8, 0)[0] != first
    ids = first.split()
    assert len(set(ids)) == 3 and all(i.startswith("soak-fail-") for i in ids)
    # The same scenario run twice in one process never hands a P the same id.
    assert again not in ids


@pytest.fixture
def vllm_loaded() -> None:
    pytest.importorskip("vllm", reason="vLLM is not importable in this environment")


def test_a_failing_soak_prints_the_seed_that_replays_it(tmp_path: Path, vllm_loaded: None) -> None:
    from kvfail.conformance.scenarios import DIRECTORY as SCENARIOS

    control = "kvfail.conformance.negative:SwallowsFailure"
    rc, log = run_child_pytest(
        [
            str(SCENARIOS / "test_concurrency_soak.py"),
            *("-k", "soak", "--kvfail-seed", "23"),
            *("--connector", control, "--policy", "fail", "--layout", "tp1"),
        ],
        tmp_path,
        600,
    )
    assert rc == pytest.ExitCode.TESTS_FAILED, log
    assert f"soak seed 23: replay with --kvfail-seed 23 -k soak --connector {control}" in log


def test_a_shorter_soak_runs_the_first_batches_of_the_same_plan(vllm_loaded: None) -> None:
    """``--kvfail-soak-batches N`` (the audit's short soak) cuts the seeded plan, never
    draws another: its N batches are the first N of the full soak's, fault for fault."""
    import random
    from types import SimpleNamespace

    from kvfail.conformance.scenarios.test_concurrency_soak import (
        SOAK_BATCH,
        SOAK_BATCHES,
        SOAK_FAILS,
        soak_plan,
    )
    from kvfail.faults import FaultPoint

    caps = SimpleNamespace(faults={*SOAK_FAILS, FaultPoint.ABORT_WHILE_WAITING})
    scenario = SimpleNamespace(caps=caps)
    full = soak_plan(scenario, random.Random(5), SOAK_BATCHES)  # type: ignore[arg-type]
    short = soak_plan(scenario, random.Random(5), 2)  # type: ignore[arg-type]
    assert len(full) == SOAK_BATCHES * SOAK_BATCH and len(short) == 2 * SOAK_BATCH
    assert short == full[: len(short)]
    assert {p for p in full} > {None}  # the plan mixes faults in, not only successes
