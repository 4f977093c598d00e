"""End to end between separate hosts: ``vllm serve`` P on a simulated host of its own (a
network namespace made by this test), kvfail's D servers in the test's namespace, KV over
a real link that is cut mid-run and then healed.

Why: a partition is neither a dead P nor a stopped one. P lives and may still be working on
pulls it received before the cut; its answers come back only after the heal. Afterwards no
request may have run on wrong KV, nothing may be left waiting, D's KV usage must return to
where it was, and P/D must give the fault-free tokens again.
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
    running_deployment,
    through_proxy,
    wait_idle,
    warm_up,
    watched_metrics,
)
from e2e.servers import metric
from e2e.test_pd import DEADLINE_S, N_PROMPTS, _assert_policy_outcomes, _fault_run
from kvfail.faults.netns import NamespaceHost, netns_unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def link() -> Iterator[NamespaceHost]:
    reason = netns_unavailable()
    if reason:
        pytest.fail(f"simulated hosts are needed here: {reason}", pytrace=False)
    with NamespaceHost() as made:
        yield made


@pytest.fixture(scope="module", params=["mooncake"])
def dep(
    request: pytest.FixtureRequest,
    link: NamespaceHost,
    model_dir: str,
    e2e_dir: Path,
    summary: dict[str, Any],
) -> Iterator[Deployment]:
    log_dir = e2e_dir / f"{request.param}-hosts"
    with running_deployment(request.param, model_dir, log_dir, DEADLINE_S, summary, link=link) as d:
        yield d


def test_servers_reach_each_other_over_the_link(dep: Deployment, link: NamespaceHost) -> None:
    assert dep.p.url.startswith(f"http://{link.inner_addr}:")
    assert all(d.spec.address == link.outer_addr for d in dep.d.values())
    ps = [[7, 8, 9] * 40]
    for pol in POLICIES:  # a transfer really crossed the link: start_deployment's warm-up
        assert through_proxy(dep.proxies[pol], dep.model, ps)[0].ok


def test_partition_mid_run_then_heal(
    dep: Deployment, link: NamespaceHost, summary: dict[str, Any]
) -> None:
    """Cut the link silently while decodes wait between prefill and KV pull: D's deadline
    fails them (``fail``) or recomputes them (``recompute``), never a 200 with wrong
    tokens; after the heal, D idles at its old KV usage and serves P/D again."""
    base = {pol: watched_metrics(dep.d[pol]) for pol in POLICIES}
    usage0 = {pol: metric(base[pol], "vllm:kv_cache_usage_perc") for pol in POLICIES}
    try:
        results = _fault_run(dep, 11, lambda: link.partition("silent"), n_held=N_PROMPTS)
    finally:
        link.heal()
    _assert_policy_outcomes(dep, results, "partition", summary, silent=True)
    idle = {pol: wait_idle(dep.d[pol], usage0[pol], 60.0) for pol in POLICIES}
    idle["p"] = wait_idle(dep.p, None, 60.0)
    summary.setdefault(f"{dep.connector}-hosts", {})["partition_idle"] = idle
    tries = {pol: warm_up(dep.proxies[pol], dep.d[pol], dep.model) for pol in POLICIES}
    summary[f"{dep.connector}-hosts"]["heal_warmup_tries"] = tries
    ps = [[11, 12, 13, 14] * 30, [5, 4, 3] * 45]
    for pol in POLICIES:
        ref = local_reference(dep.d[pol], ps)
        outs = through_proxy(dep.proxies[pol], dep.model, ps)
        assert [o.token_ids for o in outs] == ref, f"after heal ({pol}): {outs}"
