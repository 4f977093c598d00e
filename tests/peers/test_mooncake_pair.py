"""A real Mooncake P/D pair (upstream ``MooncakeConnector``, TCP loopback) through the harness.

Why: the fault scenarios of the conformance suite are only worth something if the bytes
really travel P -> D through vLLM's real connector, and if the fast faults really reach
D's real scheduler as failures. One P process is shared by every scenario that leaves it
usable; the cold kill runs last and covers both policies with two requests prefilled
before the kill.

No assertion reads a detection time: each fault is checked by its cause (the reason
upstream's D gives for the failure, what the fault proxy saw). The times are printed
(``-s``) and attached to the records; ``bench/mooncake_detection.py`` measures them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from kvfail.faults import FaultProxy  # noqa: E402
from kvfail.harness import Engine, oracles  # noqa: E402
from kvfail.peers.mooncake import (  # noqa: E402
    MooncakePair,
    refused_bootstrap,
    unknown_engine,
)

pytestmark = pytest.mark.vllm

DETECTION: dict[str, float | None] = {}


@pytest.fixture(scope="module")
def pair() -> Iterator[MooncakePair]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = MooncakePair(policy="fail", abort_request_timeout_s=5)
    p.consumer("recompute")
    try:
        yield p
    finally:
        p.close()
        print("\nMooncake detection times (s):", DETECTION)


def _violations(pair: MooncakePair, consumer: str, req_id: str, failed: bool) -> list[str]:
    return oracles.check_all(pair.decoders[consumer], [req_id], failed=failed)


def _failure_reasons(
    pair: MooncakePair, consumer: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[str]]:
    """Why ``consumer``'s upstream worker fails each load from now on: D request id -> the
    reasons given to ``_handle_failed_recv``. A reason names the cause, a time would not."""
    worker = pair.decoders[consumer].workers[0].connector.connector_worker
    handle = worker._handle_failed_recv
    reasons: dict[str, list[str]] = {}

    def spy(pull_metas: Mapping[str, Any], req_ids: Collection[str], reason: str) -> None:
        for req_id in req_ids:
            meta = pull_metas.get(req_id)
            if meta is not None and not meta.failed:
                reasons.setdefault(meta.d_req_id, []).append(reason)
        handle(pull_metas, req_ids, reason)

    monkeypatch.setattr(worker, "_handle_failed_recv", spy)
    return reasons


def _not_found(params: Mapping[str, Any]) -> str:
    """Upstream's reason when the bootstrap query did not give D the engine it asked for."""
    return (
        f"remote engine_id {params['remote_engine_id']} not found from bootstrap server "
        f"{params['remote_bootstrap_addr']}"
    )


def _finish(pair: MooncakePair, consumer: str, req_id: str, timeout_s: float = 20.0) -> Any:
    run = pair.run([req_id], consumer=consumer, timeout_s=timeout_s)
    assert run.ok, (run, pair.records[req_id], pair.p.process.output_tail() if pair.p else "")
    return run


def test_happy_path_bytes_arrive_exactly(pair: MooncakePair) -> None:
    rec = pair.prefill_and_add("happy-0", prompt_len=100, consumer="fail")
    _finish(pair, "fail", "happy-0")
    assert pair.verify("happy-0"), rec.mismatches
    assert not rec.failed
    assert rec.reported_s is not None, rec  # named in D's finished_recving
    DETECTION["happy (finished_recving)"] = rec.reported_s
    assert _violations(pair, "fail", "happy-0", failed=False) == []
    assert pair.p is not None
    stats = pair.p.stats()
    # P frees its blocks once D's pull is done (finished_sending), bounded wait.
    deadline = time.monotonic() + 10.0
    while "happy-0" not in stats["finished_sending"] and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = pair.p.stats()
    assert "happy-0" in stats["finished_sending"], stats
    assert stats["pending_requests"] == [], stats


def test_happy_path_recompute_policy_also_loads(pair: MooncakePair) -> None:
    pair.prefill_and_add("happy-r", prompt_len=70, consumer="recompute")
    _finish(pair, "recompute", "happy-r")
    assert pair.verify("happy-r"), pair.records["happy-r"].mismatches
    assert _violations(pair, "recompute", "happy-r", failed=False) == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_wrong_bootstrap_address_is_reported_by_a_cold_d(
    pair: MooncakePair, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A D that never talked to P must query the (wrong, refused) bootstrap address."""
    rid = f"refused-{policy}"
    consumer = pair.consumer(policy, name=f"cold-refused-{policy}")
    reasons = _failure_reasons(pair, f"cold-refused-{policy}", monkeypatch)
    params = refused_bootstrap(pair.prefill(rid, 100))
    rec = pair.add(rid, params, prompt_len=100, consumer=f"cold-refused-{policy}")
    _finish(pair, f"cold-refused-{policy}", rid)
    assert rec.failed and rec.reported_s is not None, rec
    assert reasons == {rid: [_not_found(params)]}  # failed at the bootstrap, never pulled
    DETECTION[f"refused bootstrap, cold ({policy})"] = rec.reported_s
    assert oracles.check_all(consumer, [rid], failed=True) == []
    assert not pair.verify(rid)
    if policy == "recompute":
        # Recompute ran the whole prompt locally: first scheduled with 0 computed tokens.
        assert rec.mismatches == {"rank0": []}, rec


def _cold_pull_via(
    pair: MooncakePair, proxy: FaultProxy, rid: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Engine, dict[str, list[str]], dict[str, Any], Any]:
    """A cold D (``cold-<rid>``, under ``fail``) pulls ``rid`` with its bootstrap query sent
    through ``proxy``: D, why its worker fails each load (:func:`_failure_reasons`), the
    params D got and the request's record."""
    name = f"cold-{rid}"
    consumer = pair.consumer("fail", name=name)
    reasons = _failure_reasons(pair, name, monkeypatch)
    params = MooncakePair.via_proxy(pair.prefill(rid, 100), proxy)
    rec = pair.add(rid, params, prompt_len=100, consumer=name)
    return consumer, reasons, params, rec


def test_bootstrap_through_a_pass_through_proxy_pulls_correct_bytes(pair: MooncakePair) -> None:
    proxy = pair.bootstrap_proxy()
    consumer = pair.consumer("fail", name="cold-proxy-pass")
    params = MooncakePair.via_proxy(pair.prefill("proxy-pass", 100), proxy)
    rec = pair.add("proxy-pass", params, prompt_len=100, consumer="cold-proxy-pass")
    _finish(pair, "cold-proxy-pass", "proxy-pass")
    assert proxy.connections_accepted >= 1
    assert not rec.failed and pair.verify("proxy-pass"), rec
    assert oracles.check_all(consumer, failed=False) == []


def test_bootstrap_reset_by_proxy_is_reported(
    pair: MooncakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = pair.bootstrap_proxy()
    proxy.reset()
    consumer, reasons, params, rec = _cold_pull_via(pair, proxy, "proxy-reset", monkeypatch)
    _finish(pair, "cold-proxy-reset", "proxy-reset")
    assert rec.failed and rec.reported_s is not None, rec
    # The proxy RST D's query (every try), so the bootstrap never named P's engine.
    stats = proxy.stats()
    assert stats.aborted >= 1 and stats.aborted == stats.accepted, stats
    assert reasons == {"proxy-reset": [_not_found(params)]}
    DETECTION["bootstrap RST by proxy, cold (fail)"] = rec.reported_s
    assert oracles.check_all(consumer, ["proxy-reset"], failed=True) == []


def test_warm_d_ignores_the_bootstrap_address(pair: MooncakePair) -> None:
    """Observed upstream behaviour, pinned so a change is noticed: once D knows P's engine
    id it reuses the cached side-channel address and never re-queries the bootstrap
    server, so a wrong (refused) bootstrap address still yields a good pull."""
    consumer = pair.consumer("fail", name="warm")
    pair.prefill_and_add("warm-0", prompt_len=40, consumer="warm")
    _finish(pair, "warm", "warm-0")
    params = refused_bootstrap(pair.prefill("warm-1", 100))
    rec = pair.add("warm-1", params, prompt_len=100, consumer="warm")
    _finish(pair, "warm", "warm-1")
    assert not rec.failed and pair.verify("warm-1"), rec
    assert oracles.check_all(consumer, failed=False) == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_unknown_engine_id_is_reported(
    pair: MooncakePair, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = f"unknown-{policy}"
    reasons = _failure_reasons(pair, policy, monkeypatch)
    params = unknown_engine(pair.prefill(rid, 100))
    rec = pair.add(rid, params, prompt_len=100, consumer=policy)
    _finish(pair, policy, rid)
    assert rec.failed and rec.reported_s is not None, rec
    assert reasons == {rid: [_not_found(params)]}  # P's bootstrap answered, without it
    DETECTION[f"unknown engine id ({policy})"] = rec.reported_s
    assert _violations(pair, policy, rid, failed=True) == []


def test_silent_bootstrap_is_reported_after_the_connector_timeout(
    pair: MooncakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bootstrap server that accepts and never answers (proxy blackhole). Upstream's
    httpx query waits ``VLLM_MOONCAKE_CONNECTOR_TIMEOUT`` (default 30 s) per try, 3 tries;
    lowered to 1 s for D here (read at use time), so the report comes in ~3 s."""
    monkeypatch.setenv("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", "1")
    proxy = pair.bootstrap_proxy()
    proxy.blackhole()
    consumer, reasons, params, rec = _cold_pull_via(pair, proxy, "proxy-blackhole", monkeypatch)
    for _ in range(3):  # the load is scheduled; D's bootstrap query hangs at the proxy
        consumer.step()
    # What a stuck load looks like from D's worker (the suite's liveness evidence).
    state, p_state = pair.stuck_state(consumer, ["proxy-blackhole"])[:2]
    assert state.startswith("proxy-blackhole rank 0: finished recving False"), state
    # P is alive and answers: the load waits on the path to it, not on P.
    assert "; stats in " in p_state and "crashed None" in p_state, p_state
    # At the default timeout (3 x 30 s) this wait would run out: the lowered one ended it.
    _finish(pair, "cold-proxy-blackhole", "proxy-blackhole", timeout_s=15)
    assert rec.failed and rec.reported_s is not None, rec
    # D's query reached the proxy and got nothing back: only its timeout could end it.
    stats = proxy.stats()
    assert stats.accepted >= 1 and stats.bytes_to_client == 0, stats
    assert reasons == {"proxy-blackhole": [_not_found(params)]}
    DETECTION["bootstrap blackhole, connector timeout 1 s, cold (fail)"] = rec.reported_s
    assert oracles.check_all(consumer, ["proxy-blackhole"], failed=True) == []


@pytest.mark.parametrize("fault", ["error_response", "err_reqs"])
def test_p_answers_one_pull_with_an_injected_fault(pair: MooncakePair, fault: str) -> None:
    """The real P process answers D's pull of one request with the armed protocol fault
    (an ERROR reply, or FINISH with the request in ``err_reqs``); upstream D reports it as
    a failed load. The fault is one-shot and per request: the next pull is served."""
    rid = f"inject-{fault}"
    params = pair.prefill(rid, 100)
    pair.inject(rid, fault)
    rec = pair.add(rid, params, prompt_len=100, consumer="fail")
    _finish(pair, "fail", rid)
    assert rec.failed, rec
    DETECTION[f"P injects {fault} (fail)"] = rec.reported_s
    assert _violations(pair, "fail", rid, failed=True) == []
    after = f"after-{fault}"
    pair.prefill_and_add(after, 100, consumer="fail")
    _finish(pair, "fail", after)
    assert not pair.records[after].failed and pair.verify(after), pair.records[after]


def test_p_refuses_an_unknown_fault(pair: MooncakePair) -> None:
    with pytest.raises(RuntimeError, match="unknown fault"):
        pair.inject("never-added", "no_such_fault")


def test_zz_kill_p_cold_is_reported_under_both_policies(
    pair: MooncakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs last (by name): it kills the shared P. Two fresh D engines that never talked
    to this P keep it "cold": D queries P's bootstrap server, which is gone (refused)."""
    reasons: dict[str, dict[str, list[str]]] = {}
    for policy in ("fail", "recompute"):
        pair.consumer(policy, name=f"cold-{policy}")
        reasons[policy] = _failure_reasons(pair, f"cold-{policy}", monkeypatch)
    params = {policy: pair.prefill(f"kill-{policy}", 100) for policy in ("fail", "recompute")}
    pair.kill_p()
    for policy, p in params.items():
        pair.add(f"kill-{policy}", p, prompt_len=100, consumer=f"cold-{policy}")
    run = pair.run(consumers=["cold-fail", "cold-recompute"], timeout_s=20)
    assert run.ok, run
    for policy in params:
        rid = f"kill-{policy}"
        rec = pair.records[rid]
        assert rec.failed and rec.reported_s is not None, rec
        assert reasons[policy] == {rid: [_not_found(params[policy])]}  # P's bootstrap is gone
        DETECTION[f"kill P cold ({policy})"] = rec.reported_s
        assert _violations(pair, f"cold-{policy}", rid, failed=True) == []


# --------------------------------------------------------------------------- slow

WARM_REPORT_S = 90.0  # upstream D socket timeout: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s


@pytest.fixture(scope="module")
def slow_pair() -> Iterator[MooncakePair]:
    p = MooncakePair(policy="fail", abort_request_timeout_s=5)
    try:
        yield p
    finally:
        p.close()
        print("\nMooncake detection times (s):", DETECTION)


def _warm(pair: MooncakePair, consumer: str) -> None:
    """One verified pull, under the policy that ends ``consumer``'s name."""
    pair.warm(pair.consumer(consumer.split("-")[-1], name=consumer))


@pytest.mark.slow
def test_freeze_then_kill_p_warm_is_reported_after_the_socket_timeout(
    slow_pair: MooncakePair,
) -> None:
    """Silent P (SIGSTOP) after a good pull: upstream D cannot tell it from a slow P and
    reports only when its ZMQ receive times out (abort timeout + 60 s). Both policies."""
    pair = slow_pair
    names = {policy: f"warm-freeze-{policy}" for policy in ("fail", "recompute")}
    for name in names.values():
        _warm(pair, name)
    params = {policy: pair.prefill(f"{name}-x", 100) for policy, name in names.items()}
    pair.freeze_p()
    try:
        for policy, name in names.items():
            pair.add(f"{name}-x", params[policy], prompt_len=100, consumer=name)
        run = pair.run(consumers=names.values(), timeout_s=WARM_REPORT_S + 10)
        assert run.ok, run
        for policy, name in names.items():
            rec = pair.records[f"{name}-x"]
            assert rec.failed and rec.reported_s is not None, rec
            DETECTION[f"freeze P, warm ({policy})"] = rec.reported_s
            consumer = pair.decoders[name]
            assert oracles.check_all(consumer, [f"{name}-x"], failed=True) == []
    finally:
        pair.thaw_p()
