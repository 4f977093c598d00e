"""kvfail's stage counters in the Mooncake connector's stats, next to upstream's: what
``get_kv_connector_stats`` hands vLLM's logger, and ``KvfailMooncakeStats`` on its own.

The D side is :mod:`tests.connectors.mooncake_d_side`'s; P is :class:`FakePrefill`.
"""

from __future__ import annotations

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from connectors.mooncake import KvfailMooncakeConnector, KvfailMooncakeStats  # noqa: E402
from tests.connectors.fake_mooncake_p import FakePrefill  # noqa: E402
from tests.connectors.mooncake_d_side import (  # noqa: E402
    make_pull,
    poll,
    start,
)

pytestmark = pytest.mark.vllm


def test_stage_counters_reach_get_kv_connector_stats(
    mooncake_d: KvfailMooncakeConnector, fake_mooncake_p: FakePrefill
) -> None:
    mooncake_d.get_kv_connector_stats()  # start a fresh interval
    bad_params = make_pull(fake_mooncake_p.url, "ok", transfer_id="")
    peer_err = make_pull(fake_mooncake_p.url, "err")
    start(mooncake_d, bad_params, peer_err)
    poll(mooncake_d, {bad_params.req_id, peer_err.req_id})
    stats = mooncake_d.get_kv_connector_stats()
    assert isinstance(stats, KvfailMooncakeStats)
    summary = stats.reduce()
    assert summary["stage.params"] == 1 and summary["stage.peer"] == 1
    assert summary["loads_failed"] == 2
    assert summary["Num failed recvs"] == 2  # upstream's counter, fed by the tracker
    # What vLLM's logger does with the payload, aggregated across two workers.
    rebuilt = KvfailMooncakeConnector.build_kv_connector_stats(stats.to_dict())
    assert rebuilt is not None
    twice = rebuilt.aggregate(KvfailMooncakeConnector.build_kv_connector_stats(stats.to_dict()))
    assert twice.reduce()["stage.params"] == 2 and twice.reduce()["Num failed recvs"] == 4
    assert mooncake_d.get_kv_connector_stats() is None  # nothing new this interval


def test_stats_class_edge_cases() -> None:
    empty = KvfailMooncakeConnector.build_kv_connector_stats({})
    assert empty is not None and empty.is_empty()
    only_ours = KvfailMooncakeStats(data={"kvfail.stage.bootstrap": 3})
    assert not only_ours.is_empty()
    assert only_ours.reduce()["stage.bootstrap"] == 3
    assert only_ours.reduce()["Num failed recvs"] == 0
    snapshot = only_ours.clone_and_reset()
    assert isinstance(snapshot, KvfailMooncakeStats) and only_ours.is_empty()
    assert snapshot.kvfail_counters() == {"stage.bootstrap": 3}
