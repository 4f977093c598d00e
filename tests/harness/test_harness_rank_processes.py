"""Real TP ranks: each rank its own process in a real gloo world (``tp_mode="processes"``).

What must hold for a real transport to be testable at TP 2: each rank sees its own TP
rank and the real world size (vLLM's accessors, unpatched), outputs are aggregated by
vLLM's ``KVOutputAggregator`` exactly as with in-process ranks, a split forward reaches
every rank's own tensors, and a rank that dies is a recorded crash, never a hang.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.v1.request import RequestStatus

from kvfail.harness import oracles
from kvfail.harness.hooks import RankView, SplitForward

pytestmark = pytest.mark.vllm

PD = {"do_remote_prefill": True}
BUDGET = {"max_steps": 40, "timeout_s": 20.0}


def _tp_identity(view: RankView) -> tuple[int, int, int, int]:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return (
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
        view.built.vllm_config.parallel_config.tensor_parallel_size,
        os.getpid(),
    )


def _complete(view: RankView, rid: str) -> None:
    view.connector.complete(rid)  # type: ignore[attr-defined]


def _fail(view: RankView, rid: str) -> None:
    view.connector.fail(rid, block_index=0)  # type: ignore[attr-defined]


def _inflight(view: RankView) -> set[str]:
    return set(view.connector.inflight())  # type: ignore[attr-defined]


def _stamp(view: RankView, req_ids: list[str]) -> tuple[int, list[str], int]:
    """Mark this rank's first KV tensor and say who did it (a forward on the rank)."""
    first = view.built.layer_names[0]
    view.kv_caches[first].view(-1)[0] = view.rank + 7
    return view.rank, req_ids, int(view.kv_caches[first].view(-1)[0].item())


def _read_stamp(view: RankView) -> int:
    return int(view.kv_caches[view.built.layer_names[0]].view(-1)[0].item())


def _processes(make_engine: Any, name: str, **fields: Any) -> Any:
    return make_engine(engine_id=name, tp_size=2, tp_mode="processes", **fields)


def test_each_rank_is_a_real_tp_rank_in_its_own_process(make_engine: Any) -> None:
    engine = _processes(make_engine, "D-ranks-identity")
    identities = [w.call(_tp_identity) for w in engine.workers]
    assert [i[:3] for i in identities] == [(0, 2, 2), (1, 2, 2)]
    pids = {i[3] for i in identities}
    assert len(pids) == 2 and os.getpid() not in pids
    assert pids == {w.process.pid for w in engine.workers}
    with pytest.raises(AttributeError, match="own process"):
        _ = engine.workers[0].connector


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_one_rank_fails_across_processes(make_engine: Any, policy: str) -> None:
    engine = _processes(
        make_engine, f"D-ranks-{policy}", policy=policy, extra_config={"toy_mode": "hold"}
    )
    req = engine.add_request("r", kv_transfer_params=PD)
    engine.step()
    assert [w.call(_inflight) for w in engine.workers] == [{"r"}, {"r"}]

    engine.workers[0].call(_complete, "r")
    engine.step()
    # One rank's completion is not the request's (C11): vLLM's aggregator waits.
    assert [r.rank for r in engine.record.kv_reports] == [0]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    engine.workers[1].call(_fail, "r")
    engine.step()
    seen = engine.record.scheduler_reports()
    assert len(seen) == 1 and seen[0].failed_requests == {"r"}
    assert seen[0].finished_recving == {"r"}
    assert engine.run_until_idle(**BUDGET).ok
    ended = {
        "fail": RequestStatus.FINISHED_ERROR,
        "recompute": RequestStatus.FINISHED_LENGTH_CAPPED,
    }
    assert req.status == ended[policy]
    assert oracles.check_all(engine, failed=True) == []


def test_split_forward_runs_on_every_rank(make_engine: Any) -> None:
    seen: list[tuple[int, Any]] = []
    forward = SplitForward(
        plan=lambda engine, so: sorted(so.num_scheduled_tokens),
        apply=_stamp,
        collect=lambda engine, rank, result: seen.append((rank, result)),
    )
    engine = _processes(make_engine, "D-ranks-forward", forward=forward)
    engine.add_request("local", prompt_len=40, max_tokens=1)
    assert engine.run_until_idle(**BUDGET).ok
    assert seen[:2] == [(0, (0, ["local"], 7)), (1, (1, ["local"], 8))]
    # Each rank wrote its own tensors, in its own process.
    assert [w.call(_read_stamp) for w in engine.workers] == [7, 8]


def test_a_dead_rank_is_a_crash_not_a_hang(make_engine: Any) -> None:
    engine = _processes(make_engine, "D-ranks-dead")
    engine.add_request("x", prompt_len=40, max_tokens=2)
    engine.workers[1].process.kill()
    step = engine.step()
    assert step.crash is not None
    assert step.crash.phase == "worker[1]" and step.crash.exc_type == "RankDied"
    assert engine.crashed is step.crash


def _threads_and_choice(view: RankView) -> tuple[int, str | None, str | None]:
    import torch

    from kvfail.harness.threads import TORCH_THREADS_ENV

    return (
        torch.get_num_threads(),
        os.environ.get("OMP_NUM_THREADS"),
        os.environ.get(TORCH_THREADS_ENV),
    )


def test_engine_and_rank_processes_size_torch_threads(make_engine: Any) -> None:
    """The scheduler's process and each rank's process run the harness's small tensor
    work on the pool ``set_harness_threads`` chooses from the environment each sees."""
    import torch

    from kvfail.harness.threads import TORCH_THREADS_ENV

    def expected(omp: str | None, ours: str | None) -> int | None:
        if ours is not None:
            return int(ours)
        return None if omp is not None else 1  # None: the user's OMP_NUM_THREADS rules

    engine = _processes(make_engine, "D-ranks-threads")
    here = expected(os.environ.get("OMP_NUM_THREADS"), os.environ.get(TORCH_THREADS_ENV))
    if here is not None:
        assert torch.get_num_threads() == here
    for worker in engine.workers:
        threads, omp, ours = worker.call(_threads_and_choice)
        want = expected(omp, ours)
        assert threads == (want if want is not None else threads)
        if want is None:
            assert omp is not None  # the user's own choice, left as it was


def test_world_that_lost_its_rendezvous_port_starts_again(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 binds the rendezvous port after we picked it, so another bind can win (seen
    in CI as ``EADDRINUSE`` from gloo's TCPStore). A listener of ours holds the first port
    handed out, the way a stranger's bind would; the world must come up on a fresh one."""
    import socket

    from kvfail.harness import workers
    from kvfail.rig.ports import free_port

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    handed: list[int] = []

    def pick() -> int:
        port = held.getsockname()[1] if not handed else free_port()
        handed.append(port)
        return port

    monkeypatch.setattr(workers, "_free_local_port", pick)
    try:
        engine = _processes(make_engine, "D-ranks-port-race")
        assert [w.call(_tp_identity)[:2] for w in engine.workers] == [(0, 2), (1, 2)]
        assert len(handed) == 2 and handed[0] == held.getsockname()[1] != handed[1]
    finally:
        held.close()
