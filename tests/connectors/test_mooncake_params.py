"""Unusable ``kv_transfer_params`` and notify-only pulls: reported (or not) by the worker,
never raised, on the worker alone and through the real ``Scheduler``
(``kvfail.harness.Engine``) for the scheduler half.

The D side and its checks are :mod:`tests.connectors.mooncake_d_side`'s; P is
:class:`FakePrefill`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from vllm.v1.request import FinishReason  # noqa: E402

from connectors.mooncake import KvfailMooncakeConnector  # noqa: E402
from connectors.mooncake.params import UNUSABLE_ENGINE  # noqa: E402
from kvfail import Stage  # noqa: E402
from kvfail.harness.config import EngineSpec  # noqa: E402
from kvfail.harness.engine import Engine  # noqa: E402
from tests.connectors.fake_mooncake_p import ONE, FakePrefill  # noqa: E402
from tests.connectors.mooncake_d_side import (  # noqa: E402
    BOUND_S,
    EXTRA,
    assert_each_fails_once,
    make_pull,
    poll,
    start,
)

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "overrides",
    [
        {"transfer_id": ""},
        {"remote_bootstrap_addr": "127.0.0.1:8998"},  # no scheme
        {"remote_bootstrap_addr": "http://127.0.0.1:notaport"},
        {"remote_engine_id": 42},
        {"engine_key": UNUSABLE_ENGINE},  # what the scheduler half forwards
    ],
    ids=["no-transfer-id", "no-scheme", "bad-port", "engine-not-str", "scheduler-rejected"],
)
def test_malformed_params_are_reported_not_raised(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill, overrides: dict[str, Any]
) -> None:
    pull = make_pull(fake_mooncake_p.url, "ok", **overrides)
    _, counted = assert_each_fails_once(mooncake_d, pull)  # starting it must not raise
    assert counted[Stage.PARAMS] == 1


def test_notify_only_pull_is_never_reported(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    """No local blocks (an abort_immediately request): P is told, the scheduler is not."""
    pull = make_pull(fake_mooncake_p.url, "ok", n_blocks=0)
    bad = make_pull(fake_mooncake_p.url, "ok", n_blocks=0, transfer_id="")
    start(mooncake_d, pull, bad)
    obs = poll(mooncake_d, set(), timeout_s=1.0, settle_s=1.0)
    assert not obs.finished and not obs.invalid  # C7
    assert fake_mooncake_p.exchanges_for(pull.req_id)  # P was still asked, to free its blocks


# ---------------------------------------------------------------------------- real Scheduler


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_scheduler_forwards_malformed_params_to_a_reported_failure(
    fake_mooncake_p: FakePrefill, policy: str
) -> None:
    """Through the real Scheduler: no crash, nothing stranded, the policy decides.

    Upstream 0.32.0 strands a request missing a key in WAITING_FOR_REMOTE_KVS, and
    raises in build_connector_meta for an unhashable remote_engine_id.
    """
    base = {"do_remote_prefill": True, "do_remote_decode": False}
    good = {**base, "transfer_id": "ok-sched", "remote_engine_id": ONE}
    cases = {
        "missing-transfer-id": {
            **base,
            "remote_engine_id": ONE,
            "remote_bootstrap_addr": fake_mooncake_p.url,
        },
        "no-scheme": {**good, "remote_bootstrap_addr": fake_mooncake_p.url.removeprefix("http://")},
        "engine-unhashable": {
            **good,
            "remote_engine_id": [ONE],
            "remote_bootstrap_addr": fake_mooncake_p.url,
        },
        "good": {**good, "remote_bootstrap_addr": fake_mooncake_p.url},
    }
    spec = EngineSpec(
        role="consumer",
        connector="KvfailMooncakeConnector",
        connector_module="connectors.mooncake",
        engine_id=f"D-sched-{policy}",
        policy=policy,  # type: ignore[arg-type]
        extra_config=EXTRA,
    )
    with Engine(spec) as engine:
        for name, params in cases.items():
            engine.add_request(name, prompt_len=70, max_tokens=2, kv_transfer_params=params)
        result = engine.run_until_idle(timeout_s=BOUND_S, poll_s=0.01)
        assert result.ok, (result, engine.record.crashes)
        assert not engine.record.crashes
        reasons = {o.request_id: o.finish_reason for o in engine.record.outputs if o.finish_reason}
        worker = engine.workers[0].connector.connector_worker
        assert worker.failure_stats()["stage.params"] == 3
        for name in cases:
            assert engine.record.load_episodes(name) == 1  # C12: no re-load after a failure
        expected_bad = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
        assert reasons == {
            "missing-transfer-id": expected_bad,
            "no-scheme": expected_bad,
            "engine-unhashable": expected_bad,
            "good": FinishReason.LENGTH,
        }
