"""The compat layer: one place that knows how vLLM releases differ, by feature.

Most tests here fake the vLLM modules compat reads (so each release's shape is tested on
any installed vLLM); the last ones check detection against the vLLM that is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvfail import FailureReporterMixin, Stage, UnsupportedLayoutError, compat

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _clear() -> None:
    compat.reset_detection()


@dataclasses.dataclass
class _Results030:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Output029:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Output030(_Output029):
    failed_recving: set[str] | None = None


class _Base029:
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def bind_gpu_block_pool(self, pool: object) -> None:
        pass


class _Base030(_Base029):
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return _Results030()

    def bind_kv_cache_manager(self, manager: object) -> None:
        pass


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, *, request_level: bool) -> None:
    """Make compat see a 0.29-shaped (no request channel) or 0.30-shaped vLLM."""
    base = types.SimpleNamespace(
        KVConnectorBase_V1=_Base030 if request_level else _Base029,
        **({"KVConnectorTransferResults": _Results030} if request_level else {}),
    )
    outputs = types.SimpleNamespace(KVConnectorOutput=_Output030 if request_level else _Output029)
    modules = {compat._BASE: base, compat._OUTPUTS: outputs}
    monkeypatch.setattr(compat, "_module", modules.get)
    _clear()


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    _clear()
    yield
    _clear()


@pytest.mark.parametrize("request_level", [False, True])
def test_features_follow_what_the_modules_offer_not_a_version(
    monkeypatch: pytest.MonkeyPatch, request_level: bool
) -> None:
    _fake_vllm(monkeypatch, request_level=request_level)
    assert compat.features() == {
        "request_level_channel": request_level,
        "output_failed_recving": request_level,
        "block_pool_binding": True,  # the pool alone (0.29) or through the manager
        "kv_cache_manager_binding": request_level,
        "get_finished": True,
        "nixl_failed_set": False,  # no NIXL module faked
        "block_level_channel": True,  # every release so far
        "multi_group_blocks_refused": False,  # no scheduler module faked
    }
    assert compat.get_finished_polled() is (not request_level)
    want = _Results030 if request_level else compat.LegacyTransferResults
    assert compat.transfer_results_type() is want
    assert compat.KVConnectorTransferResults is want  # the lazy module attribute


def test_a_results_class_without_failed_recving_is_not_the_request_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dataclasses.dataclass
    class Partial:
        finished_sending: set[str] = dataclasses.field(default_factory=set)

    base = types.SimpleNamespace(KVConnectorBase_V1=_Base030, KVConnectorTransferResults=Partial)
    monkeypatch.setattr(compat, "_module", {compat._BASE: base}.get)
    _clear()
    assert not compat.request_level_channel_available()


def test_no_vllm_at_all_means_no_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_module", lambda name: None)
    _clear()
    assert compat.features() == dict.fromkeys(compat.FEATURES, False)
    assert compat.base_method("get_transfer_results") is None


def test_base_method_is_the_base_default_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, request_level=False)
    assert compat.base_method("get_transfer_results") is None
    assert compat.base_method("get_finished") is _Base029.__dict__["get_finished"]


def test_require_names_the_missing_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, request_level=False)
    with pytest.raises(compat.MissingFeatureError, match="request_level_channel") as info:
        compat.require("request_level_channel", "the two-group scenario")
    assert info.value.feature == "request_level_channel"
    assert "the two-group scenario" in str(info.value)
    compat.require("get_finished", "anything")  # present: no error
    with pytest.raises(KeyError, match="unknown vLLM feature"):
        compat.require("teleport", "x")


def test_finished_pair_is_the_older_get_finished_shape() -> None:
    r = compat.LegacyTransferResults({"s"}, {"a", "f"})
    assert compat.finished_pair(r) == ({"s"}, {"a", "f"})
    assert compat.finished_pair(compat.LegacyTransferResults()) == (None, None)


def test_results_from_finished_accepts_both_shapes() -> None:
    r = compat.results_from_finished(({"s"}, None))
    assert (r.finished_sending, r.finished_recving, r.failed_recving) == ({"s"}, set(), set())
    same = compat.LegacyTransferResults()
    assert compat.results_from_finished(same) is same


def test_output_without_failed_recving_reads_as_empty() -> None:
    assert compat.output_failed_recving(_Output029(finished_recving={"r"})) == frozenset()
    assert compat.output_failed_recving(_Output030(failed_recving={"r"})) == {"r"}
    assert compat.output_failed_recving(_Output030()) == frozenset()


# ----------------------------------------------------------- the mixin on both shapes


class _Worker(FailureReporterMixin):
    def __init__(self, groups: int = 1) -> None:
        self.init_failure_reporter(num_kv_cache_groups=groups)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.transfer_results(finished_sending={"sent"} & finished_req_ids)


def test_without_request_channel_the_mixin_routes_by_blocks_and_polls_via_get_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_vllm(monkeypatch, request_level=False)
    w = _Worker()
    w.track_load("r", [4, 5])
    w.load_failed("r", Stage.TRANSFER, "x")
    # vLLM < 0.30 calls get_finished: the failed load finished, its blocks are invalid.
    assert w.get_finished({"sent"}) == ({"sent"}, {"r"})
    assert w.get_block_ids_with_load_errors() == {4, 5}
    assert w.get_finished(set()) == (None, None)


def test_without_request_channel_several_groups_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_vllm(monkeypatch, request_level=False)
    with pytest.raises(UnsupportedLayoutError, match="request-level failure channel"):
        _Worker(groups=2)


def test_without_request_channel_a_load_with_no_block_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.29-shaped: a load whose block ids were all unusable can be failed neither by id
    nor by block. It is never delivered as finished: the poll raises, naming the feature."""
    _fake_vllm(monkeypatch, request_level=False)
    w = _Worker()
    w.track_load("bad", [-1])  # the tracker keeps it and fails it (bad input)
    w.abandon_load("bad", Stage.PARAMS, "nothing to pull into")
    with pytest.raises(compat.NoFailureChannelError, match="request_level_channel") as info:
        w.get_finished(set())
    assert info.value.req_ids == {"bad"} and info.value.feature == "request_level_channel"
    assert compat.MISSING_FEATURE_MARK in str(info.value)
    assert w.get_finished(set()) == (None, None)  # nothing was delivered as finished


def test_the_older_poll_shape_refuses_failed_ids_instead_of_dropping_them() -> None:
    with pytest.raises(compat.NoFailureChannelError) as info:
        compat.finished_pair(compat.LegacyTransferResults(set(), {"a", "f"}, {"f"}))
    assert info.value.req_ids == {"f"}


# ----------------------------------------------------------- block level, by feature


class _Base042461:
    """A base as vLLM PR #42461 would leave it: no get_block_ids_with_load_errors."""

    get_transfer_results = _Base030.get_transfer_results
    bind_kv_cache_manager = _Base030.bind_kv_cache_manager


def _refusing_handler(self: Any, invalid_block_ids: set[int], scheduled: Any) -> set[str]:
    """Shaped like vLLM #56855's ``_handle_invalid_blocks``: an explicit refusal."""
    if len(self.kv_cache_config.kv_cache_groups) > 1:
        raise RuntimeError("block ids with several KV-cache groups")
    return set()


def _one_group_handler(self: Any, invalid_block_ids: set[int], scheduled: Any) -> set[str]:
    """Shaped like an older one: it assumes a single group and would crash on two."""
    (blocks,) = self.kv_cache_manager.get_block_ids("r")
    return {str(b) for b in blocks if b in invalid_block_ids}


def _fake_schedulers(monkeypatch: pytest.MonkeyPatch, handler: Any) -> None:
    """A 0.32-shaped vLLM whose scheduler's ``_handle_invalid_blocks`` is ``handler``."""
    scheduler = type("Scheduler", (), {"_handle_invalid_blocks": handler})
    modules = {
        compat._BASE: types.SimpleNamespace(
            KVConnectorBase_V1=_Base030, KVConnectorTransferResults=_Results030
        ),
        compat._OUTPUTS: types.SimpleNamespace(KVConnectorOutput=_Output030),
        compat._SCHEDULER: types.SimpleNamespace(Scheduler=scheduler),
    }
    monkeypatch.setattr(compat, "_module", modules.get)
    _clear()


def test_routing_uses_blocks_only_where_they_exist_and_one_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_schedulers(monkeypatch, _refusing_handler)
    assert compat.routing(1) == compat.Routing(request_level=True, block_level=True)
    several = compat.routing(2)
    assert several.request_level and not several.block_level
    assert "#56855" in several.why_not_blocks  # the scheduler's explicit refusal
    assert compat.features()["multi_group_blocks_refused"]


def test_an_older_scheduler_is_not_trusted_with_several_groups_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_schedulers(monkeypatch, _one_group_handler)
    assert not compat.multi_group_blocks_refused()
    several = compat.routing(2)
    assert not several.block_level and "crash" in several.why_not_blocks


@pytest.mark.parametrize("gone", ["base_method", "output_field"])
def test_without_the_block_channel_everything_goes_by_request(
    monkeypatch: pytest.MonkeyPatch, gone: str
) -> None:
    """vLLM PR #42461's shape: either half of the block channel missing is no channel."""

    @dataclasses.dataclass
    class Output:
        finished_recving: set[str] | None = None
        failed_recving: set[str] | None = None

    base = types.SimpleNamespace(
        KVConnectorBase_V1=_Base042461 if gone == "base_method" else _Base030,
        KVConnectorTransferResults=_Results030,
    )
    output = Output if gone == "output_field" else _Output030
    modules = {compat._BASE: base, compat._OUTPUTS: types.SimpleNamespace(KVConnectorOutput=output)}
    monkeypatch.setattr(compat, "_module", modules.get)
    _clear()
    assert not compat.features()["block_level_channel"]
    route = compat.routing(1)
    assert route.request_level and not route.block_level and "#42461" in route.why_not_blocks
    w = _Worker()
    w.track_load("r", [4, 5])
    w.load_failed("r", Stage.TRANSFER, "x", block_ids=[5])  # narrowed: still by request
    results = w.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"r"}, {"r"})
    assert w.get_block_ids_with_load_errors() == set()


def test_no_channel_at_all_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    base = types.SimpleNamespace(KVConnectorBase_V1=type("B", (), {}))
    monkeypatch.setattr(compat, "_module", {compat._BASE: base}.get)
    _clear()
    assert not compat.routing(1).reportable
    with pytest.raises(UnsupportedLayoutError, match="no block-level channel"):
        _Worker()


def test_with_request_channel_several_groups_fail_by_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_vllm(monkeypatch, request_level=True)
    w = _Worker(groups=2)
    w.track_load("r", [[1], [1]])
    w.load_failed("r", Stage.TRANSFER, "x")
    results = w.get_transfer_results(set())
    assert isinstance(results, _Results030)
    assert (results.finished_recving, results.failed_recving) == ({"r"}, {"r"})
    assert w.get_block_ids_with_load_errors() == set()


def test_mixin_adapts_an_upstream_worker_that_only_has_get_finished() -> None:
    """A kvfail worker's ``super().get_transfer_results()`` reaches an older upstream."""

    class Upstream:
        def get_finished(self) -> tuple[set[str], set[str]]:
            return {"s"}, {"r"}

    class Mine(FailureReporterMixin, Upstream):
        def __init__(self) -> None:
            self.init_failure_reporter(num_kv_cache_groups=1, request_level_channel=False)

        def get_transfer_results(self) -> Any:
            upstream = super().get_transfer_results()
            return self.transfer_results(upstream.finished_sending)

    assert Mine().get_finished() == ({"s"}, None)


def test_get_finished_does_not_recurse_through_a_default_get_transfer_results() -> None:
    """On a vLLM whose base ``get_transfer_results`` calls ``get_finished``, a connector
    that forgot to override it still reports its tracker's results, with no recursion."""

    class Base:
        def get_transfer_results(self, ids: set[str]) -> Any:
            return compat.results_from_finished(self.get_finished(ids))  # type: ignore[attr-defined]

    class Forgot(FailureReporterMixin, Base):
        def __init__(self) -> None:
            self.init_failure_reporter(num_kv_cache_groups=1, request_level_channel=True)

    w = Forgot()
    w.track_load("r", [1])
    w.load_failed("r", Stage.TRANSFER, "x")
    assert w.get_finished(set()) == (None, {"r"})
    assert w.get_block_ids_with_load_errors() == {1}


# ----------------------------------------------------------- the installed vLLM


def test_importing_compat_loads_no_vllm() -> None:
    code = (
        "import sys, kvfail.compat as c; c.FEATURES; c.LegacyTransferResults; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(not HAS_VLLM, reason="requires vllm: detection against the installed one")
def test_detection_matches_the_installed_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1.outputs import KVConnectorOutput

    has_results = hasattr(base, "KVConnectorTransferResults")
    assert compat.request_level_channel_available() is has_results
    fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    assert compat.output_has_failed_recving() is ("failed_recving" in fields)
    manager = hasattr(base.KVConnectorBase_V1, "bind_kv_cache_manager")
    assert compat.kv_cache_manager_binding_available() is manager
    assert compat.block_pool_binding_available() is (
        manager or hasattr(base.KVConnectorBase_V1, "bind_gpu_block_pool")
    )
    if has_results:
        assert compat.KVConnectorTransferResults is base.KVConnectorTransferResults
    blocks = hasattr(base.KVConnectorBase_V1, "get_block_ids_with_load_errors")
    assert compat.block_level_channel_available() is (blocks and "invalid_block_ids" in fields)
    from vllm.v1.core.sched.scheduler import Scheduler

    refuses = "kv_cache_groups) > 1" in inspect.getsource(Scheduler._handle_invalid_blocks)
    assert compat.multi_group_blocks_refused() is refuses
    assert not compat.routing(2).block_level  # on every release


@pytest.mark.skipif(not HAS_VLLM, reason="requires vllm: the harness's own modules import it")
def test_kvfail_vllm_modules_import_on_the_installed_vllm() -> None:
    """The harness, the negative controls and kvfail's connectors import on every release
    (each used to import a 0.30-only name at load)."""
    code = (
        "import kvfail.harness.toy, kvfail.harness.engine, kvfail.conformance.negative, "
        "connectors.mooncake, connectors.nixl"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
