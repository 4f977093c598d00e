"""End to end: kvfail's guard around upstream's MooncakeConnector on a real ``vllm serve`` D.

The deployment: P runs upstream's ``MooncakeConnector`` (through ``e2e.upstream``), and two
Ds (``fail``, ``recompute``) run ``KvfailGuardConnector`` configured around the same class,
with no code change in it (``e2e.servers.guard_transfer_config``). Upstream alone strands a
load from a frozen P (docs/upstream-verdicts.md); with the guard, the held requests fail (or
are recomputed) at the guard's deadline, nothing runs on wrong KV, and once P resumes the
blocks the guard held come back: D's KV usage returns to 0 (read from its ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.pd import (
    POLICIES,
    Deployment,
    local_reference,
    missing_serve_reason,
    start_deployment,
    through_proxy,
    wait_idle,
    warm_up,
)
from e2e.servers import ServerSpec, metric
from e2e.test_pd import DEADLINE_S, N_PROMPTS, _assert_policy_outcomes, _fault_run, _prompt_set

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

#: How long D may take to return every held block once P resumes: P's stalled sends land
#: (the inner then reports the load), then the guard's next drain ends the hold.
RELEASE_S = 60.0


@pytest.fixture(scope="module")
def guarded(model_dir: str, e2e_dir: Path, summary: dict[str, Any]) -> Iterator[Deployment]:
    reason = missing_serve_reason("mooncake")
    if reason:
        pytest.skip(reason)
    d_specs = {
        pol: ServerSpec(
            f"D-guard-{pol}",
            "mooncake",
            "kv_consumer",
            policy=pol,
            deadline_s=DEADLINE_S,
            impl="guard",
        )
        for pol in POLICIES
    }
    dep = start_deployment(
        "mooncake",
        model_dir,
        e2e_dir / "guard-mooncake",
        DEADLINE_S,
        d_specs=d_specs,
        p_impl="upstream",
    )
    try:
        yield dep
    finally:
        dep.close()


def test_guard_ends_a_frozen_p_and_returns_every_block(
    guarded: Deployment, summary: dict[str, Any]
) -> None:
    """SIGSTOP P while every decode waits for its KV: the guard's deadline fails them (or,
    under recompute, recomputes them), never a 200 with tokens that differ from D's own;
    after SIGCONT, D's KV usage returns to 0 and P/D gives the fault-free tokens again."""
    dep = guarded
    for pol in POLICIES:  # the precondition: a fault-free P/D answer is D's own answer
        ps = _prompt_set(0)[:2]
        outs = through_proxy(dep.proxies[pol], dep.model, ps)
        assert [o.token_ids for o in outs] == local_reference(dep.d[pol], ps), pol
    try:
        results = _fault_run(dep, 1, dep.p.proc.freeze, n_held=N_PROMPTS)
    finally:
        if dep.p.proc.alive:
            dep.p.proc.thaw()
    # Fail or recompute within the deadline plus slack; no 200 with wrong tokens.
    _assert_policy_outcomes(dep, results, "guard_freeze", summary, silent=True)
    idle = {pol: wait_idle(dep.d[pol], 0.0, RELEASE_S) for pol in POLICIES}
    held = {pol: metric(dep.d[pol].metrics(), "vllm:kvfail_quarantined_blocks") for pol in POLICIES}
    summary.setdefault("guard-mooncake", {})["after_thaw"] = {"idle": idle, "held": held}
    assert held == {pol: 0.0 for pol in POLICIES}, held
    for pol in POLICIES:
        warm_up(dep.proxies[pol], dep.d[pol], dep.model)
        ps = _prompt_set(2)[:2]
        outs = through_proxy(dep.proxies[pol], dep.model, ps)
        assert [o.token_ids for o in outs] == local_reference(dep.d[pol], ps), pol
