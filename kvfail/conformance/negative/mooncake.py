"""Negative controls on a REAL connector: kvfail's Mooncake connector broken in ONE way.

Each control is :class:`connectors.mooncake.KvfailMooncakeConnector` with its worker
broken in one method: the breakages of the toy's first rows again (a swallowed failure, a
late report, an unknown id, a success on failure; :data:`EXPECTED_FLAGS_REAL`), driven by
the real Mooncake driver, so the real P process and TCP transport provoke the fault (P
answers the pull with an ERROR reply) and the real scheduler sees the result. Defined
only where the Mooncake connector can be imported (:data:`EXPECTED_FLAGS_REAL` is empty
otherwise).

Each breakage is put in front of the built worker's class (:mod:`.rebind` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from kvfail.compat import KVConnectorTransferResults
from kvfail.conformance.negative.flag import Flag
from kvfail.conformance.negative.rebind import break_worker
from kvfail.stages import Stage

__all__ = ["EXPECTED_FLAGS_REAL", "EXPECTED_FLAGS_REAL_DEADLINE", "EXPECTED_FLAGS_REAL_HETERO"]

log = logging.getLogger("kvfail.conformance.negative")


class _SwallowsFailureWorker:
    """Every failure call only logs (pre-#50984 Mooncake): nothing is reported, so the
    request waits; only the tracker's own deadline (30 s by default) could end it."""

    def load_failed(self, req_id: str, stage: Stage | str, reason: str, **_: Any) -> bool:
        log.warning("load %s failed (%s): %s", req_id, stage, reason)  # and nothing else
        return True

    def abandon_load(self, req_id: str, stage: Stage | str, reason: str) -> bool:
        log.warning("load %s abandoned (%s): %s", req_id, stage, reason)
        return True


class _ReportsLateWorker:
    """``finished_recving`` on time; the failure (request or blocks) one pass later (C3)."""

    _late_ids: set[str]
    _late_blocks: set[int]

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()  # type: ignore[misc]
        late = getattr(self, "_late_ids", set())
        self._late_ids = set(results.failed_recving)
        results.failed_recving = late
        return results  # type: ignore[no-any-return]

    def get_block_ids_with_load_errors(self) -> set[int]:
        now = super().get_block_ids_with_load_errors()  # type: ignore[misc]
        late = getattr(self, "_late_blocks", set())
        self._late_blocks = set(now)
        return late


class _ReportsUnknownIdWorker:
    """The first time it reports a failure it also reports a made-up id as finished."""

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()  # type: ignore[misc]
        failing = set(results.failed_recving) or (
            set(results.finished_recving) if getattr(self, "_kvfail_invalid", None) else set()
        )
        if failing and not getattr(self, "_made_up_once", False):
            self._made_up_once = True
            results.finished_recving = set(results.finished_recving) | {
                f"{rid}-retry" for rid in failing
            }
        return results  # type: ignore[no-any-return]


class _ReportsSuccessOnFailureWorker:
    """A failed pull is reported as a success (the HF3FS pattern): D's blocks keep
    whatever was there, and the request runs on it."""

    def load_failed(
        self,
        req_id: str,
        stage: Stage | str,
        reason: str,
        *,
        peer: Hashable | None = None,
        **_: Any,
    ) -> bool:
        return self.load_succeeded(req_id, peer=peer)  # type: ignore[attr-defined,no-any-return]


try:
    from connectors.mooncake import KvfailMooncakeConnector as _KvfailMooncake
except Exception:  # Mooncake or vLLM's Mooncake module not importable: no real controls
    _KvfailMooncake = None

if _KvfailMooncake is not None:

    class _BrokenMooncake(_KvfailMooncake):  # type: ignore[misc,valid-type]
        """Base of the real controls: the one broken worker method comes from
        ``_broken_worker``, put in front of whatever worker class the connector built."""

        _broken_worker: type

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            break_worker(self, self._broken_worker)

    class SwallowingMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector whose failure calls only log."""

        _broken_worker = _SwallowsFailureWorker

    class LateMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector reporting each failure one pass after finished_recving."""

        _broken_worker = _ReportsLateWorker

    class UnknownIdMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector that once reports an id the scheduler never had."""

        _broken_worker = _ReportsUnknownIdWorker

    class SuccessOnFailureMooncake(_BrokenMooncake):
        """KvfailMooncakeConnector reporting a failed pull as a success."""

        _broken_worker = _ReportsSuccessOnFailureWorker

    class UnboundedMooncake(_KvfailMooncake):  # type: ignore[misc,valid-type]
        """KvfailMooncakeConnector that ignores the deadline it is configured with: it
        declares none and enforces none, so a load ends only when P answers or goes away
        (C10). A P that never answers strands the load; a slow one ends it late, which
        must be the same verdict whatever P's speed."""

        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            from kvfail.deadline import DEADLINE_KEY

            transfer = vllm_config.kv_transfer_config
            transfer.kv_connector_extra_config = {
                **(transfer.kv_connector_extra_config or {}),
                DEADLINE_KEY: None,
            }
            super().__init__(vllm_config, *args, **kwargs)

    class ReleasesUnprovenMooncake(_KvfailMooncake):  # type: ignore[misc,valid-type]
        """KvfailMooncakeConnector that gives a failed load's blocks back at its deadline,
        without proof that P's write is over: its max hold is a millisecond (a D that
        trusts its clock, or a closed side channel, instead of P's writer)."""

        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            from connectors.mooncake.fence import MAX_HOLD_KEY

            transfer = vllm_config.kv_transfer_config
            transfer.kv_connector_extra_config = {
                **(transfer.kv_connector_extra_config or {}),
                MAX_HOLD_KEY: 0.001,
            }
            super().__init__(vllm_config, *args, **kwargs)

    __all__ += [
        "LateMooncake",
        "ReleasesUnprovenMooncake",
        "SuccessOnFailureMooncake",
        "SwallowingMooncake",
        "UnboundedMooncake",
        "UnknownIdMooncake",
    ]

#: Real-connector controls: class -> (scenario, clause text in the failure reason). The
#: suite's REAL_BUDGET_S is below the connector's default deadline, which is what makes a
#: swallowed failure a liveness violation rather than a late watchdog report.
EXPECTED_FLAGS_REAL: dict[str, Flag] = (
    {
        "SwallowingMooncake": Flag("test_failed_load_one_group", "C2/C10 liveness"),
        "LateMooncake": Flag("test_failed_load_one_group", "C3 late"),
        "UnknownIdMooncake": Flag("test_failed_load_one_group", "C7 crash"),
        "SuccessOnFailureMooncake": Flag("test_failed_load_one_group", "C1 wrong bytes"),
    }
    if _KvfailMooncake is not None
    else {}
)

#: Real-connector controls at P TP 2 with D TP 1 (``--layout p2d1``), where D's one rank
#: reads from both P ranks and loses one: the first controls' breakages, shown in a shape
#: only real rank processes build.
EXPECTED_FLAGS_REAL_HETERO: dict[str, Flag] = (
    {
        "SwallowingMooncake": Flag("test_p_rank_lost_while_d_reads_from_both", "C2/C10 liveness"),
        "SuccessOnFailureMooncake": Flag(
            "test_p_rank_lost_while_d_reads_from_both", "C1 wrong KV", frozenset({"recompute"})
        ),
    }
    if _KvfailMooncake is not None
    else {}
)

#: Real-connector controls of the deadline scenarios, each flagged by every scenario
#: named (a P that never answers, and a slow one that does): the toy's P cannot be slow
#: and still answer, so only a real P shows that the verdict ignores P's speed. The
#: late-write scenarios (a slow P, a P shut down mid-write) catch a D that frees blocks
#: a real P then writes into.
EXPECTED_FLAGS_REAL_DEADLINE: dict[str, tuple[Flag, ...]] = (
    {
        "ReleasesUnprovenMooncake": (
            Flag("test_slow_peer_writes_after_deadline", "C11 write after release"),
            Flag("test_p_shutdown_mid_write", "C11 write after release"),
        ),
        "UnboundedMooncake": (
            Flag("test_silent_peer_caught_by_deadline", "C10 no deadline"),
            Flag("test_slow_peer_writes_after_deadline", "C10 no deadline"),
        ),
    }
    if _KvfailMooncake is not None
    else {}
)
