"""What a scenario test gets: the driver, the capabilities, the policy, bounded waits and
the oracles, behind one object (the ``scenario`` fixture).

Why one object: every scenario must end with the same checks (liveness, policy outcome,
no leaks, exactly once, no crash, no re-advertised hit), every wait must be bounded by
the suite and not by the connector, and every engine must be closed even when the test
fails. Putting that here keeps each scenario a short, readable story.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

from kvfail import compat
from kvfail.conformance import timebase
from kvfail.conformance.capabilities import Capabilities, CapabilityMissing
from kvfail.conformance.layout import DEFAULT_LAYOUT, Layout
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.conformance.driver import Driver
    from kvfail.harness.config import Policy
    from kvfail.harness.engine import Engine
    from kvfail.harness.records import RunResult

__all__ = [
    "ACTIVE_BUDGET",
    "ConformanceViolation",
    "HeldBlocks",
    "ScenarioContext",
    "SuiteSkip",
]

#: Bound for anything that must happen "within a few steps" (an active fault, a success).
ACTIVE_BUDGET: dict[str, Any] = {"max_steps": 60, "timeout_s": 15.0}
#: Wall-clock bound for a run over a real transport (an active fault, a real pull). Real
#: active faults are reported well within it (see the report's ``detected_s``); the bound stays
#: below kvfail's default 30 s deadline so that a swallowed failure (which only that
#: deadline would end) is a liveness violation, not a slow pass.
REAL_BUDGET_S = 10.0
#: Safety bound on the steps a wall-clock run may add once every load is reported (see
#: ``ScenarioContext.run``): they are bounded by ``ACTIVE_BUDGET``'s step count, and this
#: only ends a run whose steps hang.
HUNG_STEPS_S = 120.0
#: Loads a warm-up may take to succeed once (see ``ScenarioContext.warm_up``).
WARM_UP_TRIES = 3
#: A crashed engine's traceback lines a violation's evidence keeps (its innermost ones).
CRASH_TRACE_LINES = 12
#: How long the oracles wait, with the peers' faults ended, for blocks a connector holds
#: back while a peer may still write (quarantine) to come back, before calling them leaked.
HELD_BLOCKS_WAIT_S = 15.0
#: Sleep between D's steps while it waits for held blocks (a connector's drain runs on
#: D's steps; its peers progress in real time).
HELD_BLOCKS_POLL_S = 0.01
#: A wall-clock run also steps D at least this often before it may end on its timeout
#: (see ``Engine.run_until``): a verdict needs the connector to have had its drains.
MIN_STEPS = 20
#: A deadline scenario waits min(--kvfail-silent-wait, max(3 x the declared deadline + 1 s,
#: this floor)): long enough for any connector that keeps the deadline it declares.
DEADLINE_BUDGET_FLOOR_S = 5.0
#: How a failure to build D starts (an error of the run, never a skip).
ENGINE_BUILD_FAILED = "cannot build the engine"
#: Faults whose P writes into D's blocks after D failed the load: their scenarios need
#: vLLM's block pool to hold blocks of a reported load.
LATE_WRITE_POINTS = frozenset(
    {FaultPoint.SLOW_PEER_PAST_DEADLINE, FaultPoint.PEER_SHUTDOWN_MID_WRITE}
)
#: Run tags handed out in this process (see ``ScenarioContext.rid``): a real P, possibly
#: shared by several drivers and sessions, must never see a request id twice.
_TAGS: set[str] = set()
#: The soak's seed when ``--kvfail-seed`` is not given.
DEFAULT_SEED = 1729


class SuiteSkip(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A skip the suite itself raised, naming what the connector or run lacks.

    Why a type of its own: a driver is the connector author's code and runs inside the
    scenario, so a skip's text proves nothing. The plugin accepts only this type, and
    only when ``needs`` names what is really missing (see ``kvfail.conformance.hooks``);
    any other skip or xfail in a scenario fails it.
    """

    def __init__(self, reason: str, needs: Sequence[str]) -> None:
        super().__init__(reason)
        #: Capability names (``Capabilities`` fields), or ``fault`` / ``layout`` /
        #: ``driver`` for a fault point, a layout or a transport absent here.
        self.needs = tuple(needs)


class ConformanceViolation(AssertionError):
    """A scenario's oracles found violations; the message lists them, clause first."""

    def __init__(self, scenario: str, violations: list[str], evidence: Iterable[str] = ()) -> None:
        self.violations = list(violations)
        #: What the peers printed meanwhile (and, for a failed precondition, the rig's
        #: state): shown with the findings, never one of them (a baseline matches findings
        #: only).
        self.evidence = list(evidence)
        message = f"{scenario}: " + "; ".join(violations)
        if self.evidence:
            message += "\nevidence (what the peers printed during the scenario, the rig's state):"
            message += "\n  "
            message += "\n  ".join(self.evidence)
        super().__init__(message)


def only_holds_left(engine: Engine) -> bool:
    """The scheduler's own work is over and what keeps D stepping is blocks its connector
    holds back (quarantine, through ``has_pending_push_work``).

    Why the run may end there: waiting out the run's budget while a stopped P keeps the
    hold gains nothing (nothing but P's end can release it), and the oracles' own wait
    (``ScenarioContext.await_held_blocks``) ends the peers' faults and steps D, watching
    every step, until the blocks are back. A connector with pending work and no block held
    keeps stepping in the run, where a late write into a freed block is seen."""
    sched = engine.scheduler
    if sched.has_unfinished_requests() or sched.has_finished_requests():
        return False
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return free < engine.spec.num_blocks - 1  # the null block is never free


@dataclass(frozen=True)
class HeldBlocks:
    """How a wait for held blocks ended (:meth:`ScenarioContext.await_held_blocks`)."""

    #: Free blocks in D's pool when it ended.
    free: int
    #: Seconds this call waited (the bound is shared with earlier waits on the engine).
    waited_s: float
    #: D went idle with blocks missing: vLLM would not step it until a new request came.
    idle: bool


@dataclass
class ScenarioContext:
    """The ``scenario`` fixture: one connector under one policy for one scenario."""

    driver: Driver
    caps: Capabilities
    policy: Policy
    scenario: str
    silent_wait_s: float = 6.0
    node: pytest.Item | None = None
    #: The layout this run of the scenario is in (``--layout``); ``engine()`` defaults to it.
    layout: Layout = DEFAULT_LAYOUT
    #: ``--kvfail-require-drivers``: a connector that cannot be built here fails.
    require_drivers: bool = False
    engines: list[Engine] = field(default_factory=list)
    #: ``--kvfail-seed``: what request ids, prompts and the soak's plan derive from.
    seed: int | None = None
    #: ``--kvfail-soak-batches``: how many batches the soak runs (None: all of them).
    soak_batches: int | None = None
    _seq: int = 0
    _floor_s: float = 0.0
    #: Per engine (by ``id``): the request count and the clock at the start of its wait
    #: for held blocks (see ``await_held_blocks``).
    _held_since: dict[int, tuple[int, float]] = field(default_factory=dict)
    _tag: str = ""

    # ------------------------------------------------------------ gating

    def require(self, *names: str) -> None:
        """Skip (naming the capability) unless every capability in ``names`` holds."""
        for name in names:
            why = self.caps.missing(name)
            if why is not None:
                raise SuiteSkip(why, (name,))

    def require_any(self, *names: str) -> None:
        """Skip unless at least one capability in ``names`` holds (naming all of them)."""
        missing = [self.caps.missing(n) for n in names]
        if all(missing):
            raise SuiteSkip("requires any of " + " | ".join(m for m in missing if m), names)

    def require_fault(self, *candidates: FaultPoint) -> FaultPoint:
        """The first advertised fault point of ``candidates``, else a skip naming them."""
        try:
            point = self.caps.require_fault(*candidates)
        except CapabilityMissing as exc:
            raise SuiteSkip(str(exc), ("fault",)) from None
        if point in LATE_WRITE_POINTS:
            # Reported (by the deadline, C10, or a closed side channel) with its blocks
            # held while P still writes (C11): only vLLM's block pool can hold them.
            # Without it no connector can pass, so the run is an error naming the
            # feature, never a verdict.
            compat.require("block_pool_binding", f"{self.scenario} ({point.value})")
        return point

    def require_fault_on_rank(self, rank: int, *candidates: FaultPoint) -> FaultPoint:
        """The first of ``candidates`` the driver can provoke on TP rank ``rank`` alone,
        by what it declares (its fault table and the ranks each entry cannot hit alone),
        else a skip naming every candidate and the driver's reason."""
        try:
            return self.caps.require_fault_on_rank(rank, *candidates)
        except CapabilityMissing as exc:
            raise SuiteSkip(str(exc), ("fault",)) from None

    def require_layout(self, *names: str) -> None:
        """Skip unless this run's layout is one of ``names`` (a scenario whose cost or
        meaning belongs to one layout; the others cover it there)."""
        if self.layout.name not in names:
            raise SuiteSkip(
                f"requires {' or '.join(names)} layout: this run's layout is "
                f"{self.layout.name} (--layout {names[0]})",
                ("layout",),
            )

    def deadline_budget(self, deadline: float | None) -> float:
        """The suite's bounded wait for a load only a deadline can end (see
        :data:`DEADLINE_BUDGET_FLOOR_S`)."""
        wait = float(self.silent_wait_s)  # already in the machine's time (the fixture)
        if deadline is None:
            return wait
        return min(wait, timebase.scaled(max(3 * deadline + 1.0, DEADLINE_BUDGET_FLOOR_S)))

    def declared_deadline_s(self, engine: Engine) -> float | None:
        """The load deadline D's connector declares (see :mod:`kvfail.deadline`); None
        when it declares none. Noted in the report, so a verdict shows what it assumed."""
        from kvfail.deadline import UNDECLARED, declared_deadline_s

        connector = getattr(engine.scheduler, "connector", None)
        value = declared_deadline_s(connector)
        self.note("declared_deadline_s", "undeclared" if value is UNDECLARED else value)
        return None if value is UNDECLARED else value  # type: ignore[return-value]

    # ------------------------------------------------------------ engines

    def engine(
        self,
        *,
        num_kv_cache_groups: int | None = None,
        tp_size: int | None = None,
        deadline: bool = False,
    ) -> Engine:
        """A fresh D engine for this scenario, closed at teardown; TP size and groups
        default to the scenario's layout (a scenario that needs one names it).

        A connector that cannot be built (its module does not import, its constructor
        raises, its build never ends) fails the scenario: a skip here would let a
        connector that never runs pass.
        """

        groups = num_kv_cache_groups or self.layout.num_kv_cache_groups
        tp = tp_size or self.layout.tp_size
        if groups > 1:
            # Block ids are not unique across groups: without failed_recving no connector
            # can report a failure right (C5), so this is an error, never a verdict.
            compat.require("request_level_channel", f"{self.scenario} with {groups} groups")
        # P's TP size goes only to a driver of a heterogeneous layout (one that declares
        # hetero_tp: the layout requires it), so other drivers keep the plain signature.
        p_tp = {"p_tp_size": self.layout.p_tp} if self.layout.heterogeneous else {}
        try:
            engine = self.driver.build_engine(
                self.policy, num_kv_cache_groups=groups, tp_size=tp, deadline=deadline, **p_tp
            )
        except Exception as exc:
            pytest.fail(
                f"{ENGINE_BUILD_FAILED}: {self.caps.connector} ({type(exc).__name__}: {exc})",
                pytrace=False,
            )
        self.engines.append(engine)
        return engine

    def close(self, *, failed: bool = False) -> None:
        """Close this scenario's engines and drop the driver's handles of them (their
        faults and records go with them: no driver has to remember it), then let the
        driver repair shared peers (told first when the scenario ``failed``). The
        verdict is in by now: the driver may first bring back what the engines' shutdown
        talks to (``before_close``)."""
        try:
            if self.engines:
                self.driver.before_close()
            for engine in self.engines:
                engine.close()
            self.engines.clear()
        finally:
            if failed:
                self.driver.scenario_failed()
            self.driver.forget_engines()
            self.driver.after_scenario()

    def note(self, key: str, value: Any) -> None:
        """Attach a measurement (e.g. a detection time) to this scenario's report record."""
        if self.node is not None:
            self.node.user_properties.append((key, value))

    def wait_floor(self, seconds: float) -> None:
        """Note a wait no connector could shorten (a deadline that must pass, a peer's
        delay): ``bench.suite_speed`` sums these into the suite's floor."""
        self._floor_s += seconds
        self.note("floor_s", round(self._floor_s, 3))

    def warm_up(self, engine: Engine, *, tries: int = WARM_UP_TRIES) -> None:
        """One good load on ``engine`` first, so this D has talked to the peer ("warm").

        Up to ``tries`` loads: a deadline scenario's D has a short deadline, and a cold
        first load includes the handshake (a TP 2 NIXL D's can outlast a short deadline
        on a busy machine, and that deadline then failed the warm-up, not the scenario).
        Being warm is the precondition, not the thing under test; ``test_successful_load``
        tests a cold load. A D that never loads well in ``tries`` is a violation."""
        found: list[str] = []
        for _ in range(tries):
            rid = self.rid("warmup")
            self.add_loading(engine, rid)
            self.driver.settle(engine, rid)
            self.run(engine)
            found = self.violations(engine, [rid], failed=False)
            if not found:
                return
            if engine.crashed is not None:  # no retry on a dead engine
                break
        raise self.violation(
            [f"warm-up load ({tries} tries): {v}" for v in found],
            evidence=self._rig_state(engine, [rid]),
        )

    def next_traffic(self, engine: Engine) -> str:
        """Serve one request D computes itself, after the scenario's own requests ended.

        Why: a report the connector sends after the scheduler let an id go (a repeat of a
        failure, a late signal of an aborted load) lands in the next step D takes, and in
        service that step comes with the next request. An engine left idle after its last
        request never shows it, so a scenario about what happens after a free serves one
        more request before it is judged. Returns that request's id."""
        if engine.crashed is not None:
            return ""
        rid = self.driver.add_local_request(engine, self.rid("next"))
        self.run(engine)
        return rid

    def _rig_state(self, engine: Engine, request_ids: list[str]) -> list[str]:
        """Evidence for a precondition that failed (a warm-up that never loaded): what D's
        and P's sides hold for ``request_ids`` and the machine's busiest processes, so a
        failure shows whether a peer was idle, busy, or got no CPU."""
        from kvfail.rig.procfs import busiest_processes

        try:
            state = list(self.driver.stuck_state(engine, request_ids))
        except Exception as exc:  # evidence only: never hide the finding itself
            state = [f"(the driver's stuck_state raised {exc!r})"]
        return [*state, "busiest processes: " + "; ".join(busiest_processes())]

    @property
    def seed_value(self) -> int:
        return DEFAULT_SEED if self.seed is None else self.seed

    def rid(self, stem: str) -> str:
        """A request id that depends only on the seed, this scenario run (connector,
        scenario, policy, layout) and its place in the scenario, never on what ran
        before: a rerun with ``--kvfail-seed`` and ``-k`` adds the same ids, and so the
        same prompts (they derive from the id). Unique in the process all the same (a real
        P must never see an id twice): a scenario run seen again here gets a suffix."""
        if not self._tag:
            key = "|".join(
                (
                    str(self.seed_value),
                    self.caps.connector_path,
                    self.caps.driver,
                    self.scenario,
                    self.policy,
                    self.layout.name,
                )
            )
            base = hashlib.sha256(key.encode()).hexdigest()[:6]
            tag, n = base, 1
            while tag in _TAGS:
                n += 1
                tag = f"{base}.{n}"
            _TAGS.add(tag)
            self._tag = tag
        self._seq += 1
        return f"{stem}-{self.policy}-{self._tag}-{self._seq}"

    def add_loading(
        self,
        engine: Engine,
        request_id: str,
        *,
        fault: FaultPoint | None = None,
        ranks: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Add a remote-prefill request and step until its load is in flight.

        ``fault`` is armed first (on ``ranks``, for a fault on one rank), for drivers
        that must set it up before the request exists. Returns the block ids its load
        uses (all groups, flattened), for
        :func:`kvfail.conformance.report_timing.check_not_late`.
        """
        if fault is not None:
            self.driver.arm(engine, request_id, fault, ranks=ranks)
        self.driver.add_remote_request(engine, request_id, **kwargs)
        driver = self.driver

        def waiting(e: Engine) -> bool:
            driver.observe(e)
            return request_id in e.waiting_for_remote()

        result = engine.run_until(waiting, max_steps=10, timeout_s=timebase.scaled(10.0))
        if not result.ok:
            raise self.violation(
                [f"C12 setup: {request_id} never entered WAITING_FOR_REMOTE_KVS ({result})"]
            )
        groups = engine.scheduler.kv_cache_manager.get_block_ids(request_id)
        return [b for g in groups for b in g]

    def run(self, engine: Engine, *, timeout_s: float | None = None) -> RunResult:
        """Step until idle, bounded by the suite (never by the connector)."""
        budget = dict(ACTIVE_BUDGET)
        if timeout_s is not None or self.driver.poll_s:
            # Wall-clock bound: a deadline or a real transport progresses in real time.
            budget = {
                "max_steps": 1_000_000,
                "timeout_s": timeout_s or timebase.scaled(REAL_BUDGET_S),
                "min_steps": MIN_STEPS,
            }
        driver = self.driver

        def idle(e: Engine) -> bool:
            driver.observe(e)
            return e.is_idle() or only_holds_left(e)

        poll_s = self.driver.poll_s or (0.01 if timeout_s else 0.0)
        result = engine.run_until(idle, poll_s=poll_s, **budget)
        if result.reason != "timeout" or engine.waiting_for_remote():
            return result
        # Every load has been reported: what is left (a recompute, the decode steps) is
        # the scheduler's own work, which a verdict bounds in steps, not in the time a
        # loaded machine takes for them. The wall clock only guards against a hung step.
        rest = engine.run_until(
            idle, poll_s=poll_s, max_steps=ACTIVE_BUDGET["max_steps"], timeout_s=HUNG_STEPS_S
        )
        return replace(
            rest, steps=result.steps + rest.steps, elapsed_s=result.elapsed_s + rest.elapsed_s
        )

    # ------------------------------------------------------------ oracles

    def violations(
        self,
        engine: Engine,
        request_ids: Iterable[str] | None = None,
        *,
        failed: bool | None,
        policy_outcome: bool = True,
    ) -> list[str]:
        """Every harness oracle's findings, clause first (empty when all hold)."""
        from kvfail.harness import oracles

        ids = list(engine.requests) if request_ids is None else list(request_ids)
        out = oracles.check_no_crash(engine)
        stuck = oracles.check_liveness(engine)
        if stuck and engine.crashed is None:
            try:
                # Every request still in the scheduler is stuck, a finished one whose
                # blocks are held as much as one still waiting for remote KV.
                state = self.driver.stuck_state(engine, sorted(engine.scheduler.requests))
            except Exception as exc:  # evidence only: never hide the finding itself
                state = [f"(the driver's stuck_state raised {exc!r})"]
            stuck += [f"C2/C10 state: {line}" for line in state]
        out += stuck
        self.await_held_blocks(engine)
        out += oracles.check_no_leaks(engine)
        out += oracles.check_exactly_once(engine)
        out += oracles.check_no_readvertise_after_failure(engine)
        if engine.crashed is None:
            out += self.driver.integrity_findings(engine)
        if policy_outcome and engine.crashed is None:
            for rid in ids:
                out += oracles.check_policy_outcome(engine, rid, failed=failed)
        return out

    def await_held_blocks(self, engine: Engine, want: int | None = None) -> HeldBlocks:
        """Give blocks a connector holds back (quarantine) the time to come back.

        A connector may keep a failed load's blocks while its peer may still write into
        them: the contract's own rule (C11). Once every request is done, the peer's
        faults are ended (a frozen P resumes and finishes its write; a dead P stays dead)
        and D is stepped as vLLM's engine loop would, until ``want`` blocks are free
        (default: every block but the null one), for at most :data:`HELD_BLOCKS_WAIT_S`.
        What is still missing then is the caller's to judge (the leak oracle's, or a
        scenario's own).

        One bound per engine, counted from the first wait after its last request was
        added: a scenario that waits for its blocks itself (the quarantine scenarios) and
        the oracles' wait after it share it, so a hold that never ends is waited out once.
        The wait also ends when D goes idle (``scheduler.has_requests()`` false: no
        request and no pending connector work): vLLM steps no idle engine until a new
        request comes, so no block can come back in it.
        """
        sched = engine.scheduler
        pool = sched.kv_cache_manager.block_pool
        target = engine.spec.num_blocks - 1 if want is None else want  # the null block
        free = pool.get_num_free_blocks()
        if engine.crashed is not None or free >= target or sched.get_num_unfinished_requests():
            return HeldBlocks(free, 0.0, idle=False)
        marker = len(engine.requests)
        began = self._held_since.get(id(engine))
        if began is None or began[0] != marker:
            self.driver.end_faults(engine)
            began = (marker, time.monotonic())
            self._held_since[id(engine)] = began
        started, bound = time.monotonic(), timebase.scaled(HELD_BLOCKS_WAIT_S)
        idle = False
        while engine.crashed is None and pool.get_num_free_blocks() < target:
            if time.monotonic() - began[1] >= bound:
                break
            if engine.is_idle():
                idle = True
                break
            engine.step()
            self.driver.observe(engine)
            time.sleep(HELD_BLOCKS_POLL_S)
        free = pool.get_num_free_blocks()
        if free >= target:
            self.note("held_blocks_back_s", round(time.monotonic() - began[1], 3))
        return HeldBlocks(free, time.monotonic() - started, idle=idle)

    def check(
        self,
        engine: Engine,
        request_ids: Iterable[str] | None = None,
        *,
        failed: bool | None,
        extra: Iterable[str] = (),
        policy_outcome: bool = True,
    ) -> None:
        """Run every oracle (plus ``extra`` findings); raise on any violation."""
        out = self.violations(engine, request_ids, failed=failed, policy_outcome=policy_outcome)
        self.assert_clean([*out, *extra])

    def assert_clean(self, violations: Iterable[str]) -> None:
        out = list(violations)
        if out:
            raise self.violation(_dedupe(out))

    def violation(
        self, violations: list[str], *, evidence: Iterable[str] = ()
    ) -> ConformanceViolation:
        """This scenario's findings, with what its peers printed while it ran (and any
        other ``evidence``)."""
        try:
            printed = self.driver.peer_output()
        except Exception as exc:  # evidence only: never hide the findings themselves
            printed = [f"(the driver's peer_output raised {exc!r})"]
        return ConformanceViolation(
            self.scenario, violations, [*printed, *self._crash_evidence(), *evidence]
        )

    def _crash_evidence(self) -> list[str]:
        """Where each of this scenario's engines crashed: the finding can be a setup step
        (a load that never started) that only saw ``reason='crash'``."""
        out: list[str] = []
        for n, engine in enumerate(self.engines):
            for crash in engine.record.crashes:
                out.append(
                    f"[engine {n} crash] {crash.exc_type} in {crash.phase} at step "
                    f"{crash.step}: {crash.message}"
                )
                lines = [ln for ln in crash.traceback.splitlines() if ln.strip()]
                out += [f"[engine {n} crash]   {ln}" for ln in lines[-CRASH_TRACE_LINES:]]
        return out


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [i for i in items if not (i in seen or seen.add(i))]
