"""A P/D deployment for the tests: one P, one D per failure policy, one proxy per D.

Why one P shared by both Ds: a P serves any number of Ds, and every server start costs minutes
on a 2-core machine; starting all three at once overlaps their (import-bound) startups.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from e2e.client import Outcome, complete, complete_all, prompts
from e2e.proxy import Backend, PDProxy
from e2e.servers import (
    Impl,
    ServerSpec,
    VllmServer,
    metric,
    missing_serve_modules,
    start_server,
)
from kvfail.faults.netns import NamespaceHost

Policy = Literal["fail", "recompute"]
POLICIES: tuple[Policy, ...] = ("fail", "recompute")

#: Metric names worth recording before/after each fault (D side).
WATCHED = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
    "vllm:request_success_total",
    "vllm:prompt_tokens_by_source_total",
)


@dataclass
class Deployment:
    connector: Literal["nixl", "mooncake"]
    model: str
    log_dir: Path
    deadline_s: float
    p: VllmServer
    #: The Ds, keyed by their failure policy (the tests) or by what else tells them apart
    #: (``bench.pd_overhead``: which connector D runs).
    d: dict[str, VllmServer]
    proxies: dict[str, PDProxy] = field(default_factory=dict)
    p_engine_id: str | None = None

    def backend(self, key: str) -> Backend:
        return Backend(
            self.p.url, self.d[key].url, self.connector, self.p_engine_id, self.p.bootstrap_addr
        )

    def swap_p(self, p: VllmServer) -> None:
        """Point every proxy at a new (restarted) P; reap the old one (killed or not)."""
        old, self.p = self.p, p
        old.close()
        for policy, proxy in self.proxies.items():
            proxy.backend = self.backend(policy)

    def servers(self) -> list[VllmServer]:
        return [self.p, *self.d.values()]

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        for s in self.servers():
            s.close()


def p_spec(
    connector: Literal["nixl", "mooncake"],
    engine_id: str | None,
    impl: Impl = "kvfail",
    link: NamespaceHost | None = None,
) -> ServerSpec:
    return ServerSpec("P", connector, "kv_producer", engine_id=engine_id, impl=impl, link=link)


def start_deployment(
    connector: Literal["nixl", "mooncake"],
    model: str,
    log_dir: Path,
    deadline_s: float,
    policies: tuple[Policy, ...] = POLICIES,
    *,
    d_specs: Mapping[str, ServerSpec] | None = None,
    p_impl: Impl = "kvfail",
    link: NamespaceHost | None = None,
) -> Deployment:
    """Start P and the Ds concurrently and wait for all (bounded by `START_TIMEOUT_S` each),
    then put a proxy in front of each D and warm it up. The Ds are kvfail's, one per policy
    in `policies`, unless `d_specs` names them (keyed as in `Deployment.d`). With ``link``,
    P runs on that simulated host and the Ds reach it over the link."""
    # Mooncake's P returns no kv_transfer_params: the router must know P's engine id.
    p_engine = f"P-{connector}-e2e" if connector == "mooncake" else None
    if d_specs is None:
        d_specs = {
            pol: ServerSpec(
                f"D-{pol}",
                connector,
                "kv_consumer",
                policy=pol,
                deadline_s=deadline_s,
                link=link,
            )
            for pol in policies
        }
    p = start_server(p_spec(connector, p_engine, p_impl, link), model, log_dir)
    dep = Deployment(connector, model, log_dir, deadline_s, p, {}, p_engine_id=p_engine)
    try:
        for key, spec in d_specs.items():
            dep.d[key] = start_server(spec, model, log_dir)
        for s in dep.servers():
            s.wait_ready()
        for key in dep.d:
            dep.proxies[key] = PDProxy(dep.backend(key))
            warm_up(dep.proxies[key], dep.d[key], model)
    except BaseException:
        dep.close()
        raise
    return dep


@contextlib.contextmanager
def running_deployment(
    connector: Literal["nixl", "mooncake"],
    model: str,
    log_dir: Path,
    deadline_s: float,
    summary: dict[str, Any],
    *,
    link: NamespaceHost | None = None,
) -> Iterator[Deployment]:
    """A test module's deployment: skipped where ``vllm serve`` or the transport cannot
    run here, its start-up time recorded under ``summary[log_dir.name]``, and closed at
    the end whatever the tests did."""
    reason = missing_serve_reason(connector)
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    dep = start_deployment(connector, model, log_dir, deadline_s, link=link)
    summary.setdefault(log_dir.name, {})["startup_s"] = round(time.monotonic() - t0, 1)
    try:
        yield dep
    finally:
        dep.close()


#: The module each transport's worker imports.
TRANSPORT_MODULES = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}


def missing_serve_reason(connector: str) -> str | None:
    """Why a ``vllm serve`` of ``connector`` cannot run here, or None."""
    missing = missing_serve_modules()
    if missing:
        return f"vllm serve cannot import {missing}: run scripts/setup.sh (requirements/serve.txt)"
    try:
        found = importlib.util.find_spec(TRANSPORT_MODULES[connector]) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"{TRANSPORT_MODULES[connector]} not importable: the {connector} worker cannot start"
    return None


def warm_up(proxy: PDProxy, d: VllmServer, model: str, tries: int = 8) -> int:
    """One P/D request at a time until one *really transfers*; returns the tries it took.

    Why: D's first load from a P includes the handshake (NIXL: zmq, 5 s receive timeout;
    Mooncake: P's bootstrap query, then the TransferEngine's first connect), and kvfail's
    deadline counts it. On a loaded small machine the cold first pull can take longer
    than a 5 s deadline, so it fails.
    Later ones, over the established connection, are quick. A 200 is not proof of a
    transfer: under ``recompute`` a failed load is recomputed locally and still answers
    200 (this is what made the Mooncake tier look like "D computes locally"). So a try
    counts only if D's ``prompt_tokens_by_source{external_kv_transfer}`` grew. Tests
    assume a warm D.
    """
    ps = prompts(tries, length=140, seed=99)
    for i, p in enumerate(ps):
        # A D that does not answer /metrics in time (seen right after a thaw) costs a try.
        before = _external_tokens_or_none(d)
        ok = asyncio.run(complete(proxy.url, model, p, i)).ok
        after = _external_tokens_or_none(d)
        if ok and before is not None and after is not None and after > before:
            return i + 1
    raise RuntimeError(f"no P/D request through {proxy.url} transferred KV in {tries} tries")


def _external_of(m: dict[str, float]) -> float:
    return metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def _external_tokens_or_none(d: VllmServer) -> float | None:
    m = d.metrics_or_none()
    return None if m is None else _external_of(m)


def external_tokens(d: VllmServer) -> float:
    """Prompt tokens D took from a KV transfer so far (its Prometheus counter)."""
    return _external_of(d.metrics())


def watched_metrics(server: VllmServer) -> dict[str, float]:
    """The metrics worth recording before/after a fault, keyed without the labels every
    series shares (``engine``, ``model_name``); ``_created`` timestamps and kvfail series
    still at 0 are left out to keep the summary readable."""
    watched = {w.removesuffix("_total") for w in WATCHED}
    out: dict[str, float] = {}
    for key, value in server.metrics().items():
        base = key.split("{")[0]
        if base.endswith("_created"):
            continue
        if base.removesuffix("_total") in watched or ("kvfail" in base and value):
            out[_SHARED_LABELS.sub("", key).replace("{}", "").replace(",}", "}")] = value
    return out


_SHARED_LABELS = re.compile(r'(?:engine|model_name)="[^"]*",?')


def local_reference(server: VllmServer, prompts: list[list[int]]) -> list[list[int] | None]:
    """Greedy outputs of D computing the prompt itself (no KV transfer)."""
    outs = asyncio.run(complete_all(server.url, server.model, prompts))
    return [o.token_ids if o.ok else None for o in outs]


def through_proxy(
    proxy: PDProxy, model: str, prompts: list[list[int]], first_idx: int = 0
) -> list[Outcome]:
    return asyncio.run(complete_all(proxy.url, model, prompts, first_idx))


def wait_idle(
    server: VllmServer, baseline_usage: float | None, timeout_s: float
) -> dict[str, float]:
    """Poll the server's /metrics until nothing waits or runs and (unless
    ``baseline_usage`` is None) KV usage is back to its baseline."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics_or_none()
        if m is None:  # not answering yet: keep polling until the deadline
            if time.monotonic() > deadline:
                raise AssertionError(f"{server.spec.name}: /metrics unanswered for {timeout_s}s")
            time.sleep(0.5)
            continue
        waiting = metric(m, "vllm:num_requests_waiting")
        running = metric(m, "vllm:num_requests_running")
        usage = metric(m, "vllm:kv_cache_usage_perc")
        if (
            waiting == 0
            and running == 0
            and (baseline_usage is None or usage <= baseline_usage + 1e-9)
        ):
            return {"waiting": waiting, "running": running, "kv_usage": usage}
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{server.spec.name} not idle after {timeout_s}s: waiting={waiting} "
                f"running={running} kv_usage={usage} (baseline {baseline_usage})"
            )
        time.sleep(0.5)


async def held_run(
    proxy: PDProxy,
    model: str,
    prompts: list[list[int]],
    first_idx: int,
    n_held: int,
    fault: Any,
    timeout_s: float = 300.0,
) -> tuple[list[Outcome], float]:
    """Send all prompts with the proxy's gate closed; once `n_held` prefills are done and
    waiting, run `fault()` (kill or freeze P), then open the gate. Returns the outcomes and
    the monotonic time at which the decodes were released."""
    proxy.hold()
    tasks = [
        asyncio.create_task(complete(proxy.url, model, p, first_idx + i))
        for i, p in enumerate(prompts)
    ]
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, proxy.wait_held, n_held, 240.0)
        await loop.run_in_executor(None, fault)
    finally:
        released = time.monotonic()
        proxy.release()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    return list(outs), released
