"""The conformance driver for NIXL: a real P process, each scenario's D a fresh engine here.

Why its own driver: how to give D a remote prefill, and how to break it, is NIXL-specific.
:class:`NixlDriver` adapts :class:`kvfail.peers.nixl.NixlPair` (P in its own OS process,
real ``Scheduler`` + NIXL pull connector, UCX TCP on 127.0.0.1) to the suite's
:class:`~kvfail.conformance.driver.Driver` API and advertises only the fault points that
are real with NIXL here:

* ``kill_before_pull``: SIGKILL P after D's handshake, before its READ (warm D: right
  away; cold D: D is stepped once and the driver waits for the handshake): the READ post
  raises ``nixlRemoteDisconnectError`` at once;
* ``kill_one_peer``: D loads from two P processes at once, P and the pair's second P
  (its own process, side channel and engine id, started for the scenario and closed after
  it); the second P is SIGKILLed after D's handshake with it, before its READs, while P
  serves its own;
* ``freeze_peer``: SIGSTOP P after the handshake: the READ stays in ``PROC``. Only D's own
  deadline can end it (the suite's wait bounds the scenario); kvfail's connector declares
  and enforces ``kvfail_deadline_s``;
* ``net_delay``: a slow but live P. P's process group is stopped once D added the
  requests and continued :attr:`~kvfail.conformance.pair_driver.PairDriver.NET_DELAY_S` later
  (by :meth:`NixlDriver.observe`, after D's next step past that time). Over UCX/TCP a READ
  is not one-sided on the wire: P's UCX worker answers each GET, so a warm D's READ waits
  in ``PROC`` (as for ``freeze_peer``) and then completes with P's bytes; a cold D's
  handshake waits on P's side-channel listener the same way. A delay of the handshake
  alone would hold nothing for a warm D, which never handshakes again;
* ``slow_peer_past_deadline``: the same stall, until D gave the load up: a warm D's READ
  is posted to the stopped P, D's deadline passes, and P goes on
  :data:`~kvfail.conformance.driver.LATE_WRITE_STEPS` D steps after the scenario first
  asks for the late write (:meth:`NixlDriver.late_write_finding`; steps, not a timer, so
  a loaded machine cannot land the write before D's report). The READ then completes,
  writing P's bytes into the blocks D gave the load, whatever D did with them meanwhile.
  Needs a warm D (a cold D's READ would wait for the handshake, and nothing would be
  posted). At the thaw the driver digests the load's blocks on every D rank, lets P run
  :attr:`NixlDriver.LATE_SETTLE_S` without stepping D, and digests them again: what
  changed meanwhile only the transfer wrote (:meth:`NixlDriver.late_write_finding` says where);
* ``refuse``: a side-channel port nobody listens on: zmq retries a refused connect
  silently, the handshake fails at its 5 s ``RCVTIMEO``;
* ``unknown_engine``: P's real params naming another engine id;
* ``peer_bad_metadata`` / ``peer_metadata_mismatch``: P's real side channel answers the
  cold D's handshake with NIXL agent bytes that NIXL cannot load, or with a well-formed
  agent whose KV blocks are half D's size (P's compatibility hash is real, so D gets past
  it); D's handshake fails (``handshake_failed``). Served only while armed, for one
  scenario; the driver checks that P really served it;
* ``notify_failed``: D's done-notification to P never arrives (D side, at the transport
  boundary: the real READ is posted without its notification, an explicit ``send_notif``
  raises ``nixlBackendError``). The pulled KV is good, so the load must succeed. After
  the scenario the driver checks that it fired and that P was never told, then ends P's
  send lease (what ``kv_lease_duration`` does 30 s later) so P gets its blocks back;
* ``abort_while_waiting`` and ``notify_only_empty_blocks`` (driver-side).
* ``tp_one_rank`` (layout ``tp2``): SIGKILL the P TP rank the scenario names (either),
  after P prefilled every request and before D steps; P's scheduler (which serves the
  side channel for both ranks) and the other rank live on, so D's other rank pulls its
  shard and D's rank of the dead one fails its READ.

TP 2 is real (``--layout tp2``): P and D each run two TP rank processes in a real gloo
world (``tp_mode="processes"``), D's rank ``r`` handshakes for and READs P's rank ``r``,
and the byte check is per rank. The driver keeps one pair (one P) per layout.

Not advertised, on purpose: ``net_blackhole`` (the handshake would time out at 5 s, which
is not the silent case the scenario means), protocol faults answered by P (NIXL's P sends
no reply to a READ that could carry an error: its UCX worker serves the data, upstream's
code is not on that path), malformed params (the suite's malformations name Mooncake
fields).

D runs in this process, so this process creates nixl agents and would segfault at exit:
the pair installs :func:`kvfail.peers.nixl_exit_guard.install_exit_guard`, which ends the
process with ``os._exit(<pytest's exit status>)``.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvfail.conformance.claims import DriverClaim, Probe
from kvfail.conformance.driver import (
    LATE_WRITE_STEPS,
    Claim,
    Declared,
    Fault,
    Provocation,
    abort_request,
)
from kvfail.conformance.nixl_fault_state import KillOnProvoke, LateRead
from kvfail.conformance.pair_driver import Arming, OnPeer, PairDriver, PairInjector
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine

__all__ = ["NixlDriver", "make_driver", "make_upstream_driver", "nixl_bases"]


def nixl_bases() -> tuple[type, type | None] | None:
    """(upstream ``NixlConnector``, kvfail's connector or None); None without NIXL/vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    except Exception:
        return None
    try:
        from connectors.nixl import KvfailNixlConnector
    except Exception:
        return NixlConnector, None
    return NixlConnector, KvfailNixlConnector


#: The P processes a throwaway pull has warmed (see ``NixlDriver._warm_p``).
_WARM_P: weakref.WeakSet[Any] = weakref.WeakSet()


class NixlDriver(PairDriver):
    """A real NIXL P/D pair (see the module docstring).

    ``connector``/``connector_module`` pick D's connector: kvfail's (``connectors.nixl``,
    ``--connector nixl``), upstream's (``--connector vllm:NixlConnector``) or any
    ``NixlConnector`` subclass (``module:Class``). P always runs upstream's
    ``NixlConnector``: a D-side scenario must not depend on kvfail's P.
    """

    pair_module = "kvfail.peers.nixl"
    pair_name = "NixlPair"
    #: Every (D's TP, groups, P's TP) of 1 or 2: P's TP may differ from D's (p2d1, p1d2).
    layouts = frozenset(itertools.product((1, 2), (1, 2), (1, 2)))
    hand_off_p = True
    collect_closed_engines = True
    #: What P's registry key starts with: P's transfer mode is part of its compatibility
    #: hash, so a pull P is never shared with a push driver.
    P_KEY = "nixl-P"
    #: After a ``slow_peer_past_deadline`` P is thawed, how long its UCX worker gets to
    #: answer the READ it was sent while stopped (a loopback GET takes milliseconds).
    LATE_SETTLE_S = 0.5
    #: P requests D never reads (their leases are ended after the scenario): ended in a
    #: batch once they and the requests about to be prefilled reach this many, so a long
    #: scenario does not run P out of blocks.
    UNRELEASED_BATCH = 16
    #: A fault on P's process comes once D added the requests: a cold D's must wait for
    #: D's handshake, and a warm D's READ must be posted to the stopped P.
    on_peer_after_add = True

    def __init__(
        self,
        name: str = "nixl",
        *,
        connector: str = "KvfailNixlConnector",
        connector_module: str | None = "connectors.nixl",
    ) -> None:
        #: ``net_delay``: id(P handle) -> (P, when observe() thaws it).
        self._thaw_at: dict[int, tuple[Any, float]] = {}
        #: The bad metadata P was armed with in this scenario, if any.
        self._bad_metadata: str | None = None
        #: (faults, P request id) armed by ``notify_failed`` in this scenario.
        self._notify_armed: list[tuple[Any, str]] = []
        #: P request ids D will never release (P's lease is ended after the scenario).
        self._unreleased: list[str] = []
        #: The pair of the scenario's last remote request (its P's faults are checked).
        self._scenario_pair: Any = None
        self._init_pair_driver(name, connector, connector_module)

    @classmethod
    def for_class(cls, name: str, connector_cls: type, registry_name: str | None) -> NixlDriver:
        """The driver for a ``NixlConnector`` subclass resolved by ``--connector``."""
        if registry_name is not None:
            return cls(name, connector=registry_name, connector_module=None)
        return cls(
            name, connector=connector_cls.__name__, connector_module=connector_cls.__module__
        )

    @staticmethod
    def _connector_bases() -> tuple[type, type | None] | None:
        return nixl_bases()

    #: The worker method that moves the blocks in this driver's transfer mode (pull: D's
    #: worker READs them from P).
    MOVES_BLOCKS_BY = "_read_blocks"
    #: How that mode reads in the run's header.
    MODE = "pull: D READs from P"

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector whose constructor opens a NIXL agent and builds a worker that moves
        blocks this driver's way. P always runs upstream's connector of the mode."""
        agents = probe.builds_from("nixl")
        workers = probe.builds_with(cls.MOVES_BLOCKS_BY)
        if not agents or not workers:
            return None
        why = (
            f"builds a NIXL agent ({agents[0].__module__}) and "
            f"{', '.join(w.__qualname__ for w in workers)} ({cls.MODE})"
        )
        return DriverClaim(why, lambda name: cls.for_class(name, probe.cls, probe.registry_name))

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int, p_tp_size: int) -> Any:
        """A pair of this layout. P always runs upstream's connector, so every
        NIXL driver of a session (of one transfer mode: :attr:`P_KEY`) can pull from the
        same P: a driver that stops hands its healthy P on (``hand_off_p``) and the next
        one starts warm."""
        import importlib

        pair_cls = getattr(importlib.import_module(self.pair_module), self.pair_name)
        pair, key = self._pair_sharing_p(
            [self.P_KEY, p_tp_size, num_kv_cache_groups],
            lambda shared: pair_cls(
                connector=self._connector,
                connector_module=self._module,
                ready_timeout_s=240.0,
                build_default_consumer=False,
                tp_size=tp_size,
                p_tp_size=p_tp_size,
                num_kv_cache_groups=num_kv_cache_groups,
                producer=shared,
            ),
        )
        pair.kvfail_share_key = key
        self._warm_p(pair)
        return pair

    def _adding_to(self, engine: Engine) -> Any:
        """The pair, noted as the scenario's (its P's faults are checked after it); P's
        leases of pulls D never reads are ended first once :attr:`UNRELEASED_BATCH` are
        pending."""
        pair = super()._adding_to(engine)
        self._scenario_pair = pair
        self._make_room(pair, 0)
        return pair

    def _make_room(self, pair: Any, incoming: int) -> None:
        """End P's leases of pulls D never reads once they and ``incoming`` requests reach
        :attr:`UNRELEASED_BATCH`: P holds a lease's blocks until it ends (upstream's
        abort timeout, minutes), so a batch that counted only the leases could find P
        without the blocks to prefill it, and wait out P's bound on a rig's leak. None
        is ended while a notify_failed pull is pending (D does read that one)."""
        if (
            self._unreleased
            and len(self._unreleased) + incoming >= self.UNRELEASED_BATCH
            and not self._notify_armed
        ):
            pair.expire_leases(self._unreleased)
            self._unreleased = []

    def _prefill_batch(
        self, pair: Any, request_ids: Sequence[str], prompt_len: int
    ) -> dict[str, dict[str, Any]]:
        """P's params; a P whose engine crashed since the last scenario (a rank died late,
        after the fault that killed it) is replaced once, then asked again."""
        self._warm_p(pair)  # a P started since (a replacement) is still cold
        self._make_room(pair, len(request_ids))
        bound = self._prefill_bound_s()
        try:
            params: dict[str, dict[str, Any]] = pair.prefill_batch(
                request_ids, prompt_len, p_bound_s=bound
            )
        except RuntimeError as exc:
            if "P crashed" not in str(exc):
                raise
            pair.kill_p()
            self._replace_p(pair, wait=True)
            self._warm_p(pair)
            params = pair.prefill_batch(request_ids, prompt_len, p_bound_s=bound)
        return params

    def _d_warm(self, engine: Engine, pair: Any, producer: Any) -> bool:
        """Whether every D worker holds ``producer``'s agent (D handshaked with it)."""
        return bool(pair.handshaked(engine, producer))

    def _warm_p(self, pair: Any) -> None:
        """One throwaway pull through a throwaway D, so P's first-handshake costs (zmq
        listener, UCX endpoints; seconds on a loaded machine, against a 5 s handshake
        timeout) are not charged to the first scenario that uses it. Once per P process
        (a replacement P is warmed before its first scenario; a P shared with another
        driver is warm already).

        A P that does not serve that pull is not fit to judge a D by: it is replaced
        once and the new one warmed. A second failure is not fatal (the scenarios report
        what the pair really does); either way the outcome is kept as evidence for the
        next failing scenario's message."""
        for attempt in (1, 2):
            producer = pair.producer()
            if producer in _WARM_P:
                return
            _WARM_P.add(producer)
            started = time.monotonic()
            error = self._warm_pull(pair)
            p_name = (producer.ready or {}).get("engine_id", "P")
            took = time.monotonic() - started
            if error is None:
                self._driver_notes.append(f"warm-up pull from {p_name}: ok in {took:.2f} s")
                return
            self._driver_notes.append(f"warm-up pull from {p_name} failed in {took:.1f} s: {error}")
            if attempt == 1:
                pair.kill_p()
                self._replace_p(pair, wait=True)
                self._driver_notes.append(f"{p_name} replaced after its failed warm-up pull")

    @staticmethod
    def _warm_pull(pair: Any) -> str | None:
        """One verified pull from P into a throwaway D; None, or why it failed."""
        engine = pair.consumer("fail", name="driver-warmup")
        try:
            pair.warm(engine)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        finally:
            engine.close()
            pair.decoders.pop("driver-warmup", None)

    def after_scenario(self) -> None:
        """Thaw a frozen P; replace a dead one without waiting for its import. Disarm P's
        bad metadata and give P back the blocks of pulls that never told it; raise if a
        fault armed in the scenario never happened (the scenario would prove nothing)."""
        pair = self._scenario_pair
        bad, notify, unreleased = self._bad_metadata, self._notify_armed, self._unreleased
        self._bad_metadata, self._notify_armed, self._unreleased = None, [], []
        self._scenario_pair = None
        self._end_delays(now=True)
        self._repair_peers()
        if pair is None or pair.p is None or not pair.p.process.alive:
            return
        problems = []
        if bad is not None and pair.serve_bad_metadata(None) == 0:
            problems.append(f"P was armed with {bad} metadata but no handshake asked for it")
        leases = pair.expire_leases(unreleased) if unreleased else {}
        for faults, p_req in notify:
            if not faults.fired(p_req):
                problems.append(f"the done-notification for {p_req} was never sent or dropped")
            elif p_req in leases.get("notified", ()):
                problems.append(f"P was notified of {p_req} although its notification failed")
        if problems:
            raise RuntimeError("NixlDriver: fault not injected: " + "; ".join(problems))

    @property
    def injectors(self) -> dict[FaultPoint, PairInjector]:
        from kvfail.peers.nixl import unknown_engine, wrong_port

        # The pair's P (or its second P, ``kill_one_peer``) dies after D's handshake.
        kill = PairInjector(on_peer=self._kill, provoke=self._kill_stopped_p)
        return {
            FaultPoint.KILL_BEFORE_PULL: kill,
            FaultPoint.KILL_ONE_PEER: kill,
            FaultPoint.FREEZE_PEER: PairInjector(on_peer=self._freeze),
            FaultPoint.NET_DELAY: PairInjector(on_peer=self._stall),
            FaultPoint.SLOW_PEER_PAST_DEADLINE: PairInjector(on_peer=self._late_read),
            FaultPoint.REFUSE: PairInjector(before_add=self._never_reaches_p(wrong_port)),
            FaultPoint.UNKNOWN_ENGINE: PairInjector(
                before_add=self._never_reaches_p(unknown_engine)
            ),
            # The bad handshake metadata P serves (kvfail.peers.nixl).
            FaultPoint.PEER_BAD_METADATA: PairInjector(before_add=self._serves("garbled")),
            FaultPoint.PEER_METADATA_MISMATCH: PairInjector(before_add=self._serves("layout")),
            FaultPoint.NOTIFY_FAILED: PairInjector(before_add=self._lose_notification),
            FaultPoint.ABORT_WHILE_WAITING: PairInjector(provoke=abort_request),
            FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS: PairInjector(),
            # Any one P rank: P's scheduler process serves every rank's handshake.
            FaultPoint.TP_ONE_RANK: PairInjector(on_peer=self._kill_p_rank),
            FaultPoint.TP_ONE_RANK_FROZEN: PairInjector(on_peer=self._freeze_p_rank),
        }

    def declared(self) -> Declared:
        return Declared(
            async_load=Claim(True, "NIXL pulls asynchronously (READ, polled each step)"),
            sync_load=Claim(False, "NIXL only advertises asynchronous loads"),
            remote_prefill=Claim(True, "a real P process prefills; D READs its blocks"),
            two_groups=Claim(
                True,
                "P and D both built with two full-attention KV-cache groups "
                "(NixlConnector is SupportsHMA)",
            ),
            real_transport=Claim(True, "nixl agent, UCX over TCP loopback, DRAM"),
            tp2=Claim(
                True,
                "P and D each run two TP rank processes in a real gloo world "
                "(tp_mode=processes); D rank r READs P rank r",
            ),
            hetero_tp=Claim(
                True,
                "P runs its own TP size (p2d1, p1d2), named in its kv_transfer_params; D's "
                "connector splits or joins P's head shards, as in production",
            ),
        )

    def observe(self, engine: Engine) -> None:
        super().observe(engine)
        waiting = engine.waiting_for_remote()
        for rid, fault in self.handle(engine).active.items():
            late = fault.state
            if isinstance(late, LateRead) and late.blocks is None and rid in waiting:
                groups = engine.scheduler.kv_cache_manager.get_block_ids(rid)
                late.blocks = tuple(tuple(g) for g in groups)
        self._end_delays()

    def _late_reads(self) -> list[LateRead]:
        """Every ``slow_peer_past_deadline`` fault's late write, on any engine."""
        return [
            f.state
            for handle in self.handles()
            for f in handle.active.values()
            if isinstance(f.state, LateRead)
        ]

    def _file_on_peer(self, call: OnPeer, state: object, request_ids: Sequence[str]) -> None:
        """File a fault on P's whole process for each of ``request_ids`` (its state: what
        :meth:`provoke` and :meth:`observe` act on later); a request armed on its own
        has its fault active already."""
        active = self.handle(call.engine).active
        for rid in request_ids:
            active.setdefault(rid, Fault(call.point, rid)).state = state

    def _delay(self, producer: Any, seconds: float | None = None) -> None:
        """``net_delay``: stop P now and let it go on :attr:`NET_DELAY_S` (or ``seconds``)
        later (in :meth:`observe`, after D's next step past that time).

        Why a stall of P's process and not of a message: with UCX over TCP a READ is not
        one-sided on the wire: P's UCX worker (its agent's progress thread) answers each
        GET with the data, so the READ of a stopped P stays in ``PROC`` (the
        ``freeze_peer`` evidence) and completes once P runs again; a cold D's handshake
        waits the same way on P's side-channel listener. P is alive throughout: a
        process paused by its host (CPU starvation, a long GC, swapping) answers late."""
        producer.process.freeze()
        at = time.monotonic() + (self.NET_DELAY_S if seconds is None else seconds)
        self._thaw_at[id(producer)] = (producer, at)

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        """The scenario asks once D gave the load up: :data:`LATE_WRITE_STEPS` D steps
        later the stopped P goes on, and once it had :attr:`LATE_SETTLE_S` to answer the
        READ, on which D ranks the load's blocks changed meanwhile (D not stepping)."""
        fault = self.handle(engine).active.get(request_id)
        late = None if fault is None else fault.state
        if not isinstance(late, LateRead):
            return None
        if late.done is None and late.gate.due(engine.record.steps):
            self._thaw(late.producer, settle=True)
        return late.done

    def _end_delays(self, *, now: bool = False) -> None:
        """Thaw each stopped P whose delay is over (every one when ``now``). A late-write
        P's delay is only its cap: :meth:`late_write_finding` lets it go, by steps."""
        for producer, at in list(self._thaw_at.values()):
            if now or time.monotonic() >= at:
                self._thaw(producer, settle=False)

    def _thaw(self, producer: Any, *, settle: bool) -> None:
        """Let a stopped P go on; with ``settle``, digest its late writes' blocks before
        and :attr:`LATE_SETTLE_S` after, D not stepping, so only P's answers wrote."""
        self._thaw_at.pop(id(producer), None)
        late = (
            [v for v in self._late_reads() if v.producer is producer and v.done is None]
            if settle
            else []
        )
        before = [v.digests() for v in late]
        proc = producer.process
        if proc.alive and proc.frozen:
            proc.thaw()
        if not late:
            return
        time.sleep(self.LATE_SETTLE_S)
        for entry, digests in zip(late, before, strict=True):
            entry.settle(digests, f"{LATE_WRITE_STEPS} D steps after D gave the load up")

    def _never_reaches_p(
        self, breaks: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Callable[[Arming, dict[str, Any]], dict[str, Any]]:
        """A ``before_add`` sending D where P is not (``breaks`` P's params). D never
        reaches P for these, so P is never told: its send lease is ended after the
        scenario, or many such pulls would fill P's blocks for the next."""

        def before_add(arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
            self._unreleased.append(params["remote_request_id"])
            return breaks(params)

        return before_add

    def _serves(self, metadata: str) -> Callable[[Arming, dict[str, Any]], dict[str, Any]]:
        """A ``before_add`` arming P's side channel to answer the handshake with bad
        ``metadata`` (checked after the scenario: it must have been asked for)."""

        def before_add(arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
            self._bad_metadata = metadata
            arming.pair.serve_bad_metadata(metadata)  # type: ignore[attr-defined]
            self._unreleased.append(params["remote_request_id"])
            return params

        return before_add

    def _lose_notification(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        """``notify_failed``: D's done-notification for this pull never reaches P."""
        faults = arming.pair.break_notifications(arming.engine)  # type: ignore[attr-defined]
        faults.arm(params["remote_request_id"])
        self._notify_armed.append((faults, params["remote_request_id"]))
        self._unreleased.append(params["remote_request_id"])
        return params

    # ------------------------------------------------------------ faults on P's process

    def _stall(self, call: OnPeer) -> None:
        """``net_delay``: P stops now and goes on :attr:`NET_DELAY_S` later."""
        self._delay(call.producer)

    def _late_read(self, call: OnPeer) -> None:
        """``slow_peer_past_deadline``: P stops, with D's READ posted to it, until
        :meth:`late_write_finding` lets it go (at most :attr:`LATE_WRITE_CAP_S`); what
        lands at the thaw is digested (:class:`LateRead`)."""
        if not call.warm:
            raise RuntimeError(
                f"NixlDriver: {call.point.value} needs a warm D (one load from P first): a "
                "cold D's READ would wait for the handshake, and no late write could land"
            )
        self._delay(call.producer, self.LATE_WRITE_CAP_S)
        for rid in call.request_ids:
            self._file_on_peer(call, LateRead(call.producer, call.engine), [rid])

    def _kill(self, call: OnPeer) -> None:
        """SIGKILL P before it served the READ. A warm D posts its READ in the step that
        schedules the request, and a READ to a dead P fails in that same step: the
        request would never be seen waiting. So P is stopped now (the READ goes out to
        it, nothing answers) and killed by :meth:`provoke`. A cold D: P dies once D's
        handshake with it is over."""
        if call.warm:
            call.producer.process.freeze()
            self._file_on_peer(call, KillOnProvoke(call.producer), call.request_ids)
        else:
            self._after_handshake(call, "kill")

    def _freeze(self, call: OnPeer) -> None:
        """SIGSTOP P once D's handshake with it is over: the READ stays in ``PROC``."""
        self._after_handshake(call, "freeze")

    @staticmethod
    def _after_handshake(call: OnPeer, kind: str) -> None:
        pair: Any = call.pair
        pair.fault_after_handshake(
            call.request_ids[0], kind, consumer=call.engine, producer=call.producer
        )

    def _kill_stopped_p(self, call: Provocation) -> None:
        """Kill the P a warm D's READ went out to while it was stopped (see :meth:`_kill`);
        once for several requests. The detection clock starts at the kill."""
        fault = self.handle(call.engine).active.get(call.request_id)
        if fault is None or not isinstance(fault.state, KillOnProvoke):
            return  # a cold D: P died after the handshake
        producer = fault.state.producer
        fault.state = None  # killed once
        pair = self._pair_of(call.engine)
        if producer.process.alive:  # once for several requests
            producer.process.kill(timeout_s=pair.kill_timeout_s)
        rec = pair.records.get(call.request_id)
        if rec is not None:  # the detection clock starts at the kill
            rec.injected_at = time.monotonic()
            rec.steps_at_injection = call.engine.record.steps


def make_driver(name: str) -> NixlDriver:
    """Entry point ``kvfail.drivers`` ``nixl``: kvfail's connector on D."""
    return NixlDriver(name)


def make_upstream_driver(name: str) -> NixlDriver:
    """Entry point ``vllm:NixlConnector``: upstream's connector on the same real pair."""
    return NixlDriver(name, connector="NixlConnector", connector_module=None)
