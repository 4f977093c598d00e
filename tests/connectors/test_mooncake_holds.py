"""KvfailMooncakeWorker's hold bookkeeping (:mod:`connectors.mooncake.fence`), in
process: no map outlives its load.

Why: a hold entry that outlives its load keeps a P "maybe writing" forever (and grows
with traffic). Built without a TransferEngine (``object.__new__`` plus the state the
methods read); the real-P paths run in ``test_mooncake_replies.py``,
``test_mooncake_no_answer.py`` and the conformance suite's quarantine scenarios.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest

from tests.transports import require_transport

require_transport("mooncake")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
    PullReqMeta,
)

from connectors.mooncake.probe import PullWriter  # noqa: E402
from connectors.mooncake.pull_state import PULL, PeerPull  # noqa: E402
from connectors.mooncake.worker import KvfailMooncakeWorker  # noqa: E402
from kvfail import Stage  # noqa: E402

pytestmark = pytest.mark.vllm


def _worker() -> Any:
    w: Any = object.__new__(KvfailMooncakeWorker)
    w.init_failure_reporter(num_kv_cache_groups=1, request_level_channel=True, quarantine=True)
    w._mc_lock = threading.Lock()
    w._mc_held = {}
    w._mc_fenced_at = {}
    w._mc_tasks = defaultdict(set)
    w._mc_unproven = defaultdict(dict)
    w._mc_max_hold_s = None
    w._mc_grace_s = 0.0
    return w


def _pull(req_id: str, blocks: list[int]) -> PullReqMeta:
    return PullReqMeta(
        d_req_id=req_id,
        transfer_id=f"x-{req_id}",
        local_block_ids=[blocks] if blocks else [],
        remote_engine_id="P",
        remote_bootstrap_addr="http://127.0.0.1:1",
    )


def test_a_request_p_answered_is_not_one_p_may_still_write() -> None:
    """P replies only after its push for the named requests ended; ``answered`` was
    never filled, so an exchange that broke after a reply kept every request held."""
    w = _worker()
    pulls = {"a": _pull("a", [1, 2]), "b": _pull("b", [3])}
    for req_id, pull in pulls.items():
        w.track_load(req_id, pull.local_block_ids, peers=[(0, "p")])
    state = PeerPull((0, "p"))
    token = PULL.set(state)
    try:
        reply = MooncakeXferResponse(
            status=MooncakeXferResponseStatus.CONTINUE, ok_reqs=["a"], err_reqs=None, err_msg=None
        )
        w.process_pulling_result(reply, pulls)
    finally:
        PULL.reset(token)
    assert state.may_still_write(pulls) == {"b"}


def test_a_notify_only_load_failed_unfenced_leaves_no_hold_entry() -> None:
    """A load with no blocks is never quarantined, so its ``_mc_held`` entry would
    never end (it stayed before)."""
    w = _worker()
    w.track_load("n", [], peers=[(0, "p")])
    w.track_load("r", [[4, 5]], peers=[(0, "p")])
    state = PeerPull((0, "p"))  # P never answered: both may still be written
    w._mc_fail_unreported(
        state, {"n": _pull("n", []), "r": _pull("r", [4, 5])}, Stage.TRANSFER, "socket error"
    )
    assert set(w._mc_held) == {"r"}


def test_fence_bookkeeping_ends_with_the_load() -> None:
    """``_mc_fenced_at`` was popped only when the fence said True; a hold that P's death
    ended (``load_fenced``) kept its entry for ever."""
    w = _worker()
    w.track_load("r", [[6]], peers=[(0, "p")])
    w._mc_unproven["r"]["tcp://127.0.0.1:1"] = PullWriter()
    w.load_failed("r", Stage.TRANSFER, "socket error", fenced=False)
    w._mc_held["r"] = 0.0
    assert w.kvfail_fence("r") is False  # P may still push: held
    assert "r" in w._mc_fenced_at
    w.drain_step()
    assert w.failure_reporter.is_quarantined("r")
    w._mc_unproven.clear()
    w._mc_release_proven(["r"])  # P found gone: released, not through the fence
    w.drain_step()
    w._mc_forget_ended()
    assert w._mc_fenced_at == {} and w._mc_held == {}


def test_a_writer_proven_gone_ends_only_its_own_pulls_holds() -> None:
    """Two loads held at one P worker address, pulled from two writers (P restarted at
    the address between the pulls). The first writer proven gone ends its load's hold;
    the other stays held, since the P now at the address may still push into it."""
    w = _worker()
    w._mc_inflight = defaultdict(dict)
    w._remote_agents, w._tp_size = {}, {}
    addr = "tcp://127.0.0.1:1"
    old, new = PullWriter(b"old", confirmed=True), PullWriter(b"new", confirmed=True)
    for req_id, writer in (("a", old), ("b", new)):
        w.track_load(req_id, [[7 if req_id == "a" else 8]], peers=[(0, "p")])
        w.load_failed(req_id, Stage.TRANSFER, "socket error", fenced=False)
        w._mc_held[req_id] = 0.0
        w._mc_unproven[req_id][addr] = writer
    w.drain_step()
    assert w.failure_reporter.is_quarantined("a") and w.failure_reporter.is_quarantined("b")
    w._mc_peer_lost(addr, "P worker restarted", [old])
    w.drain_step()
    assert not w.failure_reporter.is_quarantined("a")
    assert w.failure_reporter.is_quarantined("b")
    assert set(w._mc_held) == {"b"} and w._mc_unproven == {"b": {addr: new}}
