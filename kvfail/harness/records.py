"""What an :class:`~kvfail.harness.engine.Engine` saw, step by step: the records the
oracles read after a scenario.

Why a module of its own: the oracles, the suite and the drivers read these records, and
none of them needs the engine that fills them; the engine module holds only the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.v1.engine import FinishReason

__all__ = [
    "Crash",
    "EngineCrashedError",
    "EngineRecord",
    "KVReport",
    "OutputRecord",
    "RunResult",
    "StepRecord",
]


@dataclass(frozen=True)
class OutputRecord:
    """One ``EngineCoreOutput`` the scheduler returned from ``update_from_output``."""

    step: int
    request_id: str
    finish_reason: FinishReason | None
    new_token_ids: tuple[int, ...]
    kv_transfer_params: Mapping[str, Any] | None


@dataclass(frozen=True)
class KVReport:
    """One ``KVConnectorOutput``: a rank's raw output (``rank`` >= 0) or the scheduler's.

    ``rank`` is ``None`` for what ``update_from_output`` actually received (after TP
    aggregation). ``failed_requests`` is the harness's attribution, computed before the
    scheduler acted on it: ids in ``failed_recving`` plus every waiting or running request
    owning a block in ``invalid_block_ids``.
    """

    step: int
    rank: int | None
    finished_recving: frozenset[str]
    failed_recving: frozenset[str]
    invalid_block_ids: frozenset[int]
    finished_sending: frozenset[str]
    failed_requests: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (
            self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.finished_sending
        )


@dataclass(frozen=True)
class Crash:
    """An exception that would have killed a real EngineCore or worker."""

    step: int
    phase: str  # "update_from_output", "worker[<rank>]", "schedule", "forward[<rank>]"
    exc_type: str
    message: str
    traceback: str

    @property
    def clause(self) -> str:
        """The contract clause this crash most likely violates (for oracle messages)."""
        if self.exc_type == "RuntimeError" and "KV cache groups" in self.message:
            return "C5"
        if self.phase == "update_from_output" and self.exc_type == "AssertionError":
            return "C7"
        if self.phase.startswith("worker"):
            return "C13"
        return "crash"


@dataclass(frozen=True)
class StepRecord:
    """What one :meth:`Engine.step` did."""

    step: int
    ran: bool
    num_scheduled_tokens: int = 0
    waiting_for_remote: frozenset[str] = frozenset()
    outputs: tuple[OutputRecord, ...] = ()
    crash: Crash | None = None
    load_starts: frozenset[str] = frozenset()


@dataclass
class EngineRecord:
    """Everything observed over an engine's life, for the oracles."""

    steps: int = 0
    outputs: list[OutputRecord] = field(default_factory=list)
    #: Raw per-rank reports and the scheduler's view, in step order (empty ones skipped).
    kv_reports: list[KVReport] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    #: Index = step number (steps that ran): ids in WAITING_FOR_REMOTE_KVS right after
    #: ``schedule()``.
    waiting_for_remote: list[frozenset[str]] = field(default_factory=list)
    #: Index = step number: ids whose async load started in that step's ``schedule()``.
    load_starts: list[frozenset[str]] = field(default_factory=list)

    def scheduler_reports(self) -> list[KVReport]:
        return [r for r in self.kv_reports if r.rank is None]

    def rank_reports(self, rank: int) -> list[KVReport]:
        return [r for r in self.kv_reports if r.rank == rank]

    def outputs_for(self, request_id: str) -> list[OutputRecord]:
        return [o for o in self.outputs if o.request_id == request_id]

    def load_episodes(self, request_id: str) -> int:
        """How many async loads the request started (entries into WAITING_FOR_REMOTE_KVS)."""
        return sum(request_id in starts for starts in self.load_starts)

    def load_start_steps(self, request_id: str) -> list[int]:
        return [step for step, starts in enumerate(self.load_starts) if request_id in starts]


@dataclass(frozen=True)
class RunResult:
    """How :meth:`Engine.run_until` ended."""

    ok: bool
    reason: Literal["predicate", "max_steps", "timeout", "crash"]
    steps: int
    elapsed_s: float


class EngineCrashedError(RuntimeError):
    """Raised by :meth:`Engine.step` after a crash: a real EngineCore would be dead."""
