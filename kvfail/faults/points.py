"""The named fault points of the conformance suite, as data.

Tests, reports and the compliance matrix must all say the same thing about a fault: what
it is, whether a connector can be expected to notice it promptly or only through its own
deadline, and which contract clauses (``docs/contract.md``) it puts under test. Keeping that
here, as frozen data with no behaviour, gives every consumer one vocabulary and lets the
matrix be derived rather than hand-maintained.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "CLAUSE_TITLES",
    "FAULT_SPECS",
    "Clause",
    "Detection",
    "FaultPoint",
    "FaultSpec",
    "Injection",
    "points_for",
]


class Clause(enum.StrEnum):
    """Clause numbers of the load-error contract, defined in ``docs/contract.md``."""

    C1 = "C1"
    C2 = "C2"
    C3 = "C3"
    C4 = "C4"
    C5 = "C5"
    C6 = "C6"
    C7 = "C7"
    C8 = "C8"
    C9 = "C9"
    C10 = "C10"
    C11 = "C11"
    C12 = "C12"
    C13 = "C13"
    C14 = "C14"

    @property
    def summary(self) -> str:  # not `title`: that would shadow str.title
        return CLAUSE_TITLES[self]


CLAUSE_TITLES: Mapping[Clause, str] = MappingProxyType(
    {
        Clause.C1: "every detected load failure is reported",
        Clause.C2: "a failed async load is still reported as finished receiving",
        Clause.C3: "a failure is reported no later than the pass reporting it finished",
        Clause.C4: "a sync load's failures are reported in the pass that detects them",
        Clause.C5: "block-level reports only with one KV-cache group",
        Clause.C6: "a failed_recving id is paired with finished_recving",
        Clause.C7: "never report an id the scheduler no longer tracks",
        Clause.C8: "each completion and each failure is reported once",
        Clause.C9: "aborted and failed loads still end with finished_recving",
        Clause.C10: "the connector guarantees bounded termination",
        Clause.C11: "completion only when no write can still land in the blocks",
        Clause.C12: "advertise only loadable tokens; never re-advertise a failed hit",
        Clause.C13: "a load failure is reported, not raised",
        Clause.C14: "build_connector_meta does not modify scheduler_output",
    }
)


class Detection(enum.StrEnum):
    """How a connector can learn of the fault; decides which oracle and time budget apply."""

    ACTIVE = "active"
    """An error surfaces promptly (refused, reset, error reply): report within a few steps."""
    SILENT = "silent"
    """Nothing ever surfaces (hung peer, dropped packets): only the connector's deadline can
    end the load, so the test budget must exceed that deadline."""


class Injection(enum.StrEnum):
    """Which tool of this package (or of the harness) produces the fault."""

    PROCESS = "process"  # PeerProcess: kill / freeze the prefill peer
    NETWORK = "network"  # FaultProxy: refuse / reset / blackhole / delay
    PEER = "peer"  # a scripted peer answering wrongly on purpose
    DRIVER = "driver"  # the test driver acts on D (abort, zero-block request)
    TOPOLOGY = "topology"  # the fault hits one part of a multi-worker setup
    STORE = "store"  # the driver damages the store's files on disk (a store connector)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    description: str
    detection: Detection
    injection: Injection
    clauses: frozenset[Clause]


def _spec(description: str, detection: Detection, injection: Injection, clauses: str) -> FaultSpec:
    # Clauses as "C1 C2 C10" keep the table compact; a typo still fails at import.
    return FaultSpec(description, detection, injection, frozenset(map(Clause, clauses.split())))


class FaultPoint(enum.StrEnum):
    """A named place where the suite injects a fault; the value is a stable report id."""

    KILL_BEFORE_PULL = "kill_before_pull"
    KILL_DURING_TRANSFER = "kill_during_transfer"
    KILL_ONE_PEER = "kill_one_peer"
    FREEZE_PEER = "freeze_peer"
    REFUSE = "refuse"
    UNKNOWN_ENGINE = "unknown_engine"
    NET_BLACKHOLE = "net_blackhole"
    NET_DELAY = "net_delay"
    SLOW_PEER_PAST_DEADLINE = "slow_peer_past_deadline"
    PEER_SHUTDOWN_MID_WRITE = "peer_shutdown_mid_write"
    PEER_ERROR_RESPONSE = "peer_error_response"
    PEER_ERR_REQS = "peer_err_reqs"
    PEER_FINISH_WITHOUT_RESULT = "peer_finish_without_result"
    PEER_BAD_METADATA = "peer_bad_metadata"
    PEER_METADATA_MISMATCH = "peer_metadata_mismatch"
    NOTIFY_FAILED = "notify_failed"
    ABORT_WHILE_WAITING = "abort_while_waiting"
    NOTIFY_ONLY_EMPTY_BLOCKS = "notify_only_empty_blocks"
    TP_ONE_RANK = "tp_one_rank"
    TP_ONE_RANK_WARM = "tp_one_rank_warm"
    TP_ONE_RANK_FROZEN = "tp_one_rank_frozen"
    STORE_FILE_DELETED = "store_file_deleted"
    STORE_FILE_TRUNCATED = "store_file_truncated"
    STORE_GARBAGE_HEADER = "store_garbage_header"
    STORE_REPLACED_BY_DIR = "store_replaced_by_dir"
    STORE_DATA_OVERWRITTEN = "store_data_overwritten"
    STORE_BYSTANDER_DAMAGED = "store_bystander_damaged"
    STORE_ALL_CHILDREN_DAMAGED = "store_all_children_damaged"
    STORE_MASTER_KILLED = "store_master_killed"
    STORE_MASTER_FROZEN = "store_master_frozen"
    STORE_MASTER_RESTARTED = "store_master_restarted"
    STORE_KEY_REMOVED = "store_key_removed"
    STORE_KEY_EVICTED = "store_key_evicted"
    STORE_SEGMENT_OWNER_KILLED = "store_segment_owner_killed"

    @property
    def spec(self) -> FaultSpec:
        return FAULT_SPECS[self]

    @property
    def description(self) -> str:
        return self.spec.description

    @property
    def detection(self) -> Detection:
        return self.spec.detection

    @property
    def active(self) -> bool:
        return self.spec.detection is Detection.ACTIVE

    @property
    def silent(self) -> bool:
        return self.spec.detection is Detection.SILENT

    @property
    def injection(self) -> Injection:
        return self.spec.injection

    @property
    def clauses(self) -> frozenset[Clause]:
        return self.spec.clauses


_A, _S = Detection.ACTIVE, Detection.SILENT

FAULT_SPECS: Mapping[FaultPoint, FaultSpec] = MappingProxyType(
    {
        FaultPoint.KILL_BEFORE_PULL: _spec(
            "P is SIGKILLed after handing out its transfer params, before D starts pulling",
            _A,
            Injection.PROCESS,
            "C1 C2 C3 C10 C13",
        ),
        FaultPoint.KILL_DURING_TRANSFER: _spec(
            "P is SIGKILLed while D's pull is in flight; part of the data has already landed",
            _A,
            Injection.PROCESS,
            "C1 C2 C3 C10 C11",
        ),
        FaultPoint.KILL_ONE_PEER: _spec(
            "D loads from two P processes at once; one is SIGKILLed after handing out its "
            "transfer params, before D pulls, while the other stays alive and serves its loads",
            _A,
            Injection.PROCESS,
            "C1 C2 C3 C8 C10 C11",
        ),
        FaultPoint.FREEZE_PEER: _spec(
            "P is SIGSTOPped: its sockets stay open but it never answers (a hung peer)",
            _S,
            Injection.PROCESS,
            "C1 C2 C10 C11",
        ),
        FaultPoint.REFUSE: _spec(
            "nothing listens at the advertised address (peer gone or wrong port)",
            _A,
            Injection.NETWORK,
            "C1 C2 C3 C10",
        ),
        FaultPoint.UNKNOWN_ENGINE: _spec(
            "the transfer params name an engine or agent the transport does not know",
            _A,
            Injection.PEER,
            "C1 C2 C3 C10 C13",
        ),
        FaultPoint.NET_BLACKHOLE: _spec(
            "D<->P traffic is silently swallowed while the connections stay open",
            _S,
            Injection.NETWORK,
            "C1 C2 C10 C11",
        ),
        FaultPoint.NET_DELAY: _spec(
            "P is alive but answers late (its reply or traffic delayed): a load whose answer "
            "comes before the deadline must succeed, never be failed early, never hang",
            _S,
            Injection.PEER,
            "C2 C3 C10 C11",
        ),
        FaultPoint.SLOW_PEER_PAST_DEADLINE: _spec(
            "P is alive but slow: it answers, and writes into D's blocks, only after D's "
            "declared deadline failed the load; those blocks must not reach another request "
            "until that write is over",
            _S,
            Injection.PEER,
            "C1 C2 C10 C11",
        ),
        FaultPoint.PEER_SHUTDOWN_MID_WRITE: _spec(
            "P shuts down gracefully (its connector's shutdown, vLLM's own path) while its "
            "write into D's blocks is under way: its side channel closes at once, P never "
            "answers, and the write lands later; then P's process exits, as vLLM's engine "
            "process does once its shutdown returns; those blocks must not reach another "
            "request until the write is over",
            _A,
            Injection.PEER,
            "C1 C2 C10 C11",
        ),
        FaultPoint.PEER_ERROR_RESPONSE: _spec(
            "P answers the pull or handshake with an explicit error or a malformed reply",
            _A,
            Injection.PEER,
            "C1 C2 C3 C10 C13",
        ),
        FaultPoint.PEER_ERR_REQS: _spec(
            "P reports failed request ids, including ones D never asked for or already settled",
            _A,
            Injection.PEER,
            "C1 C3 C6 C7 C8",
        ),
        FaultPoint.PEER_FINISH_WITHOUT_RESULT: _spec(
            "P finishes and frees the request without ever sending D data or a notification",
            _S,
            Injection.PEER,
            "C1 C2 C10 C11",
        ),
        FaultPoint.PEER_BAD_METADATA: _spec(
            "P answers the handshake with agent metadata the transport cannot load (garbled)",
            _A,
            Injection.PEER,
            "C1 C2 C3 C10 C13",
        ),
        FaultPoint.PEER_METADATA_MISMATCH: _spec(
            "P answers the handshake with well-formed metadata for a KV layout unlike D's",
            _A,
            Injection.PEER,
            "C1 C2 C3 C10 C13",
        ),
        FaultPoint.NOTIFY_FAILED: _spec(
            "D's done-notification to P is lost or its send fails; the pulled KV is good",
            _A,
            Injection.DRIVER,
            "C1 C2 C7 C8 C13",
        ),
        FaultPoint.ABORT_WHILE_WAITING: _spec(
            "the request is aborted on D while its load waits for remote KV; signals may follow",
            _A,
            Injection.DRIVER,
            "C7 C9 C10 C11",
        ),
        FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS: _spec(
            "the load has no local blocks (rejected / abort_immediately): only P is notified",
            _A,
            Injection.DRIVER,
            "C7 C10",
        ),
        FaultPoint.TP_ONE_RANK: _spec(
            "with TP>1 the fault hits one rank only; the others load successfully",
            _A,
            Injection.TOPOLOGY,
            "C1 C2 C6 C8 C10 C11",
        ),
        FaultPoint.TP_ONE_RANK_WARM: _spec(
            "with TP>1, once D has loaded from P, one P rank is SIGKILLed: D asks P's "
            "bootstrap nothing again, so only that rank's share of each load fails",
            _A,
            Injection.TOPOLOGY,
            "C1 C2 C6 C8 C10 C11",
        ),
        FaultPoint.TP_ONE_RANK_FROZEN: _spec(
            "with TP>1, one P rank is SIGSTOPped after P prefilled: its sockets stay open "
            "and it answers nothing, while the other ranks serve their shards; only D's "
            "deadline can end that rank's share of each load",
            _A,
            Injection.TOPOLOGY,
            "C1 C2 C8 C10 C11",
        ),
        FaultPoint.STORE_FILE_DELETED: _spec(
            "a file the store advertised is deleted before D loads it",
            _A,
            Injection.STORE,
            "C1 C4 C13",
        ),
        FaultPoint.STORE_FILE_TRUNCATED: _spec(
            "a file the store advertised is cut to half its length before D loads it",
            _A,
            Injection.STORE,
            "C1 C4 C13",
        ),
        FaultPoint.STORE_GARBAGE_HEADER: _spec(
            "a file the store advertised starts with garbage instead of its header",
            _A,
            Injection.STORE,
            "C1 C4 C13",
        ),
        FaultPoint.STORE_REPLACED_BY_DIR: _spec(
            "a file the store advertised is replaced by a directory of the same name",
            _A,
            Injection.STORE,
            "C1 C4 C13",
        ),
        FaultPoint.STORE_DATA_OVERWRITTEN: _spec(
            "a file the store advertised keeps its format but holds other bytes",
            _A,
            Injection.STORE,
            "C1",
        ),
        FaultPoint.STORE_BYSTANDER_DAMAGED: _spec(
            "a composite connector's child that does not load the request holds other bytes "
            "for it: only a load routed to the wrong child reads them",
            _A,
            Injection.STORE,
            "C1 C8",
        ),
        FaultPoint.STORE_ALL_CHILDREN_DAMAGED: _spec(
            "every child of a composite connector has a file of the entry it matches deleted",
            _A,
            Injection.STORE,
            "C1 C4 C13",
        ),
        FaultPoint.STORE_MASTER_KILLED: _spec(
            "the store's master is SIGKILLed after D's lookup matched, before D's load",
            _A,
            Injection.PROCESS,
            "C1 C2 C10 C13",
        ),
        FaultPoint.STORE_MASTER_FROZEN: _spec(
            "the store's master is SIGSTOPped after D's lookup matched: its sockets accept, "
            "nothing answers, so only D's own deadline can end the load",
            _S,
            Injection.PROCESS,
            "C1 C2 C10",
        ),
        FaultPoint.STORE_MASTER_RESTARTED: _spec(
            "the store's master is killed after D's lookup matched and started again, empty",
            _A,
            Injection.PROCESS,
            "C1 C2 C10",
        ),
        FaultPoint.STORE_KEY_REMOVED: _spec(
            "the keys D's lookup matched are removed from the store before D's load",
            _A,
            Injection.STORE,
            "C1 C2",
        ),
        FaultPoint.STORE_KEY_EVICTED: _spec(
            "one key D's lookup matched (the prefix's last stored block) is evicted from the "
            "store before D's load, the others kept: the load is partly there",
            _A,
            Injection.STORE,
            "C1 C2",
        ),
        FaultPoint.STORE_SEGMENT_OWNER_KILLED: _spec(
            "the process whose memory segment holds the matched blocks is SIGKILLed after "
            "D's lookup, before D's load",
            _A,
            Injection.PROCESS,
            "C1 C2 C10 C13",
        ),
    }
)


def points_for(
    clause: Clause | None = None, detection: Detection | None = None
) -> tuple[FaultPoint, ...]:
    """Fault points matching the filters, in declaration order (stable test ids)."""
    return tuple(
        p
        for p in FaultPoint
        if (clause is None or clause in p.clauses)
        and (detection is None or p.detection is detection)
    )
