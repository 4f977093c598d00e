"""What the drivers over a real P/D pair share.

A pair is a real P process and the D engines built against it (``kvfail.peers.base
.PeerPair``); :class:`PairDriver` turns one into the Driver API. ``mooncake_driver``,
``nixl_driver`` and ``nixl_push_driver`` are built on it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfail.conformance import timebase
from kvfail.conformance.claims import connector_class
from kvfail.conformance.driver import Driver, EngineHandle, Fault, Injector, RemoteBatch
from kvfail.conformance.peer_health import notable_output, p_unsound, producers, spinning_ps
from kvfail.conformance.shared_producers import hand_off, register_producer, shared_producer
from kvfail.deadline import DEADLINE_KEY
from kvfail.faults.points import FaultPoint
from kvfail.peers.producer_engine import PREFILL_TIMEOUT_S

if TYPE_CHECKING:
    from kvfail.harness.config import EngineSpec, Policy
    from kvfail.harness.engine import Engine
    from kvfail.peers.base import PeerPair

__all__ = [
    "Arming",
    "OnPeer",
    "PairDriver",
    "PairHandle",
    "PairInjector",
]

logger = logging.getLogger("kvfail.conformance")


@dataclass(frozen=True)
class Arming:
    """A fault being set up on a pair, before D adds its request."""

    engine: Engine
    pair: PeerPair
    fault: Fault


@dataclass(frozen=True)
class OnPeer:
    """A fault on one P's whole process, for the requests D loads from it together."""

    engine: Engine
    pair: PeerPair
    #: The P process handle the requests come from.
    producer: Any
    #: 0: the pair's P; 1: its second P (``kill_one_peer``).
    peer: int
    request_ids: Sequence[str]
    point: FaultPoint
    #: Whether D had talked to that P before (None: the driver does not ask).
    warm: bool | None = None
    #: The P ranks a fault on one rank hits (None: the fault names no rank).
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PairInjector(Injector):
    """A fault on a real pair. ``before_add`` turns P's ``kv_transfer_params`` into the
    ones D gets, before D adds the request (a broken address, a P told to misbehave).
    ``on_peer`` hits P's whole process (kill, stop, stall): one event for every request
    D loads from it together (``add_remote_requests``), and for a lone one; the driver
    decides when, relative to D adding them."""

    before_add: Callable[[Arming, dict[str, Any]], dict[str, Any]] | None = None
    on_peer: Callable[[OnPeer], None] | None = None


@dataclass(eq=False)
class PairHandle(EngineHandle):
    """A D engine built through a pair: the pair it belongs to and its name there."""

    pair: PeerPair | None = None
    name: str = ""


class PairDriver(Driver[PairHandle]):
    """What the drivers over a real P/D pair (:class:`MooncakeDriver`, ``NixlDriver``)
    share: connector resolution, cold D engines built through the pair, faults armed at
    add time, and the pair's records for bytes and detection times.

    A subclass sets ``pair_module`` (``kvfail.peers.<transport>``, whose
    ``<transport>_available`` says whether it can run), ``pair_name`` (for messages) and
    implements :meth:`start`, :meth:`_connector_bases` and :meth:`_consumer`.
    """

    poll_s = 0.005
    #: The deadline a deadline scenario asks D's connector for, through the configuration
    #: key kvfail's connectors read (:data:`kvfail.deadline.DEADLINE_KEY`); a connector that
    #: does not read it ignores it. The suite judges by what the connector declares.
    SCENARIO_DEADLINE_S = 3.0
    #: How late a slow but live P answers (``net_delay``): many D steps long, and far
    #: enough below :attr:`SCENARIO_DEADLINE_S` that a cold D's own set-up (bootstrap,
    #: first connection) on a loaded machine still fits before it.
    NET_DELAY_S = 0.5
    #: The longest a late-write P (``slow_peer_past_deadline``) is held back when the
    #: scenario never lets its write go (a connector that stranded the load): a bound on
    #: the peer, not a verdict; the scenario's end releases it sooner.
    LATE_WRITE_CAP_S = 60.0
    #: At most this often a driver asks P whether its late write has landed.
    LATE_POLL_S = 0.25
    #: ``kvfail.peers.<transport>``: holds the pair and ``<transport>_available``.
    pair_module = ""
    #: The pair class's name, for messages.
    pair_name = ""
    #: Run the cyclic garbage collector once closed D engines are dropped: for a
    #: transport whose threads go only with the object (NIXL's agent polls a core until
    #: it is collected). Others leave the engines to reference counting: a full collection
    #: walks vLLM's whole heap, a cost every scenario would pay.
    collect_closed_engines = False

    @property
    def slow_peer_delay_s(self) -> float | None:
        """None: a slow P answers only once D gave the load up, at
        :data:`~kvfail.conformance.driver.LATE_WRITE_STEPS` D steps after the scenario
        first asks ``late_write_finding``: steps, so a loaded machine cannot move the
        write before D's report."""
        return None

    def _init_pair_driver(self, name: str, connector: str, connector_module: str | None) -> None:
        self.name = name
        self._connector = connector
        self._module = connector_module
        self._why: str | None = None
        self._pair: PeerPair | None = None
        #: Each P process's output position when the last scenario ended, by pid.
        self._output_marks: dict[int, tuple[int, int]] = {}
        #: What the driver did to its P's since then (a warm-up, a replacement), shown
        #: with their output as evidence.
        self._driver_notes: list[str] = []
        #: Pairs for the other layouts, by (D's TP, groups, P's TP); ``_pair`` is TP 1,
        #: one group.
        self._layout_pairs: dict[tuple[int, int, int], PeerPair] = {}
        #: Pairs whose P lost a rank on purpose: killed and replaced after the scenario.
        self._broken: set[int] = set()
        #: P ranks SIGSTOPped alone (``tp_one_rank_frozen``), per pair, until end_faults.
        self._frozen_ranks: dict[int, set[int]] = {}
        #: The last scenario failed: its P's are checked for a spinning thread.
        self._suspect = False
        self._seq = 0
        self.connector_cls: type = object
        try:
            self.connector_cls = connector_class(connector, connector_module)
            peers = importlib.import_module(self.pair_module)
            transport = self.pair_module.rsplit(".", 1)[-1]
            self._why = getattr(peers, f"{transport}_available")()
        except Exception as exc:  # any import failure makes the driver unavailable
            self._why = f"{connector} / {self.pair_module}: {type(exc).__name__}: {exc}"

    @staticmethod
    def _connector_bases() -> tuple[type, type | None] | None:
        """(upstream connector, kvfail's connector or None); None without the transport."""
        raise NotImplementedError

    def unavailable(self) -> str | None:
        return self._why

    def engine_spec(
        self, policy: Policy, *, num_kv_cache_groups: int = 1, tp_size: int = 1, deadline: bool
    ) -> EngineSpec:
        raise NotImplementedError(f"{type(self).__name__} builds engines through {self.pair_name}")

    def _consumer(self, pair: PeerPair, policy: Policy, name: str, deadline: bool) -> Engine:
        """A fresh D engine called ``name`` from ``pair``; ``deadline`` asks its connector
        for :attr:`SCENARIO_DEADLINE_S` through the key kvfail's connectors read."""
        extra = {DEADLINE_KEY: self.SCENARIO_DEADLINE_S} if deadline else {}
        engine: Engine = pair.consumer(policy, name=name, extra_config=extra)
        return engine

    def new_handle(self, engine: Engine) -> PairHandle:
        return PairHandle(engine)

    def build_engine(
        self,
        policy: Policy,
        *,
        num_kv_cache_groups: int = 1,
        tp_size: int = 1,
        deadline: bool = False,
        p_tp_size: int | None = None,
    ) -> Engine:
        """D at ``tp_size``, loading from a P at ``p_tp_size`` (default: D's; another size
        is a heterogeneous-TP layout, built only where :attr:`layouts` has it)."""
        pair = self._layout_pair(tp_size, num_kv_cache_groups, p_tp_size or tp_size)
        self._seq += 1
        name = f"{policy}-{self._seq}"  # a fresh name: a cold D that never talked to P
        engine = self._consumer(pair, policy, name, deadline)
        handle = self.handle(engine)
        handle.pair, handle.name = pair, name
        return engine

    # ------------------------------------------------------------ pairs and their P

    #: The (D's TP, groups, P's TP) layouts this driver's pairs can be built in.
    layouts: frozenset[tuple[int, int, int]] = frozenset({(1, 1, 1)})
    #: The faults that may be armed on a pair's second P (``add_remote_requests``, peer 1).
    SECOND_P_FAULTS = frozenset({FaultPoint.KILL_ONE_PEER})
    #: At ``stop``, leave a healthy P to the session's registry for the next driver that
    #: wants the same P, instead of closing it (:mod:`kvfail.conformance.shared_producers`).
    hand_off_p: bool = False

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int, p_tp_size: int) -> PeerPair:
        """A started pair whose D has this layout and whose P runs at ``p_tp_size``."""
        raise NotImplementedError

    def _pair_sharing_p(
        self, key_parts: Sequence[Any], make: Callable[[Any], PeerPair]
    ) -> tuple[PeerPair, str]:
        """A new pair, ``make(P)``, and its P's registry key: P is the live one the drivers
        of this session registered under ``key_parts`` (borrowed), or None, and then the
        pair starts its own, registered for the others."""
        key = json.dumps(list(key_parts))
        shared = shared_producer(key)
        pair = make(shared)
        if shared is None:
            register_producer(key, pair.p)
        return pair, key

    def start(self) -> None:
        if self._pair is None:
            self._pair = self._new_pair(1, 1, 1)

    def _layout_pair(self, tp_size: int, num_kv_cache_groups: int, p_tp_size: int) -> PeerPair:
        """The pair of this layout (built on first use), with a live P."""
        layout = (tp_size, num_kv_cache_groups, p_tp_size)
        if layout not in self.layouts:
            raise NotImplementedError(
                f"{self.pair_name} builds layouts {sorted(self.layouts)} only, not {layout}"
            )
        self.start()
        if layout == (1, 1, 1):
            return self._live(self._pair)
        if layout not in self._layout_pairs:
            self._layout_pairs[layout] = self._new_pair(*layout)
        return self._live(self._layout_pairs[layout])

    def _pairs(self) -> list[PeerPair]:
        return [p for p in (self._pair, *self._layout_pairs.values()) if p is not None]

    def stop(self) -> None:
        for pair in self._pairs():
            if self.hand_off_p:
                self._hand_off(pair)
            pair.close()
        self._pair = None
        self._layout_pairs.clear()

    def _hand_off(self, pair: PeerPair) -> None:
        """Leave ``pair``'s own, healthy P to the session registry
        (:mod:`kvfail.conformance.shared_producers`) instead of closing it, unless another
        live P already serves its key."""
        key = pair.kvfail_share_key
        producer = pair.p
        if key is None or producer is None or not pair.owns_p:
            return
        proc = producer.process
        if not proc.alive or proc.frozen or p_unsound(pair):
            return
        current = shared_producer(key)
        if current is not None and current is not producer:
            return
        hand_off(key, producer, type(self))
        pair.owns_p = False

    def _p_replaced(self, pair: PeerPair) -> None:
        """Hook: ``pair`` gets a new P (forget what pointed at the old one)."""

    def _live(self, pair: PeerPair) -> PeerPair:
        """``pair`` with a live P (a P shared with another driver may have been killed
        by that driver's scenario: this driver then starts its own; the next use waits)."""
        if pair.p is None or not pair.p.process.alive:
            self._replace_p(pair)
        return pair

    def _replace_p(self, pair: PeerPair, *, wait: bool = False) -> None:
        """Give ``pair`` a live P: the replacement another driver already registered for
        the same P (borrowed), else a new one of its own (registered for the others)."""
        self._p_replaced(pair)
        key = pair.kvfail_share_key
        shared = shared_producer(key) if key is not None else None
        if shared is not None and shared is not pair.p:
            if pair.p is not None and pair.owns_p:
                with contextlib.suppress(Exception):
                    pair.p.close()  # its own P, dead or broken: nobody else closes it
            pair.p, pair.owns_p = shared, False
            if wait:
                shared.wait_ready(pair.ready_timeout_s)
            return
        pair.restart_p(wait=wait)
        if key is not None:
            register_producer(key, pair.p)

    def _forget_closed_engines(self) -> None:
        """Drop the pairs' references to D engines a scenario closed, and collect them.

        Why: a closed engine's transport can outlive its close (NIXL's agent, whose
        progress thread polls a core, goes only with the object), and every scenario
        builds a fresh D: 19 pollers had piled up in one NIXL session.
        """
        dropped = 0
        for pair in self._pairs():
            for name, engine in list(pair.decoders.items()):
                if engine.closed:
                    del pair.decoders[name]
                    dropped += 1
        if dropped and self.collect_closed_engines:
            gc.collect()

    def scenario_failed(self) -> None:
        self._suspect = True

    def _repair_peers(self) -> None:
        """After a scenario: close a second P; thaw a frozen P; kill what is left of a P
        that lost a rank (on purpose, or a rank that died after a fault) so a driver
        sharing it sees it dead rather than half-working, or, after a failed scenario,
        one with a thread spinning while idle; replace a dead P without waiting for its
        import."""
        self._forget_closed_engines()
        suspect, self._suspect = self._suspect, False
        wedged = spinning_ps(self._pairs()) if suspect else {}
        notes = [f"P pid {pid} replaced after a failed scenario: {w}" for pid, w in wedged.items()]
        for note in notes:
            logger.warning("kvfail: %s", note)
        for pair in self._pairs():
            pair.close_second_p()  # one scenario's (``kill_one_peer``); a later one starts anew
            if pair.p is None:
                continue
            proc = pair.p.process
            if proc.alive and proc.frozen:
                pair.thaw_p()
            unsound = proc.alive and (proc.pid in wedged or p_unsound(pair))
            self._frozen_ranks.pop(id(pair), None)  # SIGKILL below ends a stopped rank too
            if id(pair) in self._broken or unsound:
                self._broken.discard(id(pair))
                pair.kill_p()
            if not proc.alive:
                self._replace_p(pair)
        # What the P's print from here on belongs to the next scenario.
        self._output_marks = {proc.pid: proc.output_marker() for proc in producers(self._pairs())}
        self._driver_notes = notes

    def after_scenario(self) -> None:
        self._repair_peers()

    def peer_output(self) -> list[str]:
        """What the driver did to its P's since the last scenario ended, then their
        error-looking lines since then (:func:`kvfail.conformance.peer_health.notable_output`)."""
        out = [f"[driver] {note}" for note in self._driver_notes]
        return out + notable_output(producers(self._pairs()), self._output_marks)

    def stuck_state(self, engine: Engine, request_ids: Iterable[str]) -> list[str]:
        return list(self._pair_of(engine).stuck_state(engine, list(request_ids)))

    def end_faults(self, engine: Engine) -> None:
        pair = self._pair_of(engine)
        producer = pair.p
        if producer is not None and producer.process.alive and producer.process.frozen:
            pair.thaw_p()
        for rank in sorted(self._frozen_ranks.pop(id(pair), set())):
            if producer is not None and producer.process.alive:
                pair.signal_p_rank(rank, signal.SIGCONT)

    def _pair_of(self, engine: Engine) -> PeerPair:
        return self.handle(engine).pair or self._pair

    def observe(self, engine: Engine) -> None:
        """The pair stamps detection times and runs the integrity oracle's watch."""
        pair = self._pair_of(engine)
        if pair is not None:
            pair.observe(engine)

    def _on_peer(self, point: FaultPoint | None) -> Callable[[OnPeer], None] | None:
        """``point``'s fault on P's whole process, if it is one (None: per request)."""
        if point is None:
            return None
        injector = self.injector(point)
        return injector.on_peer if isinstance(injector, PairInjector) else None

    def _before_add(
        self, engine: Engine, pair: PeerPair, request_id: str, params: Any
    ) -> tuple[Any, Fault | None]:
        """Take the fault armed for ``request_id`` (if any) and apply its ``before_add``
        to P's ``params``: (the params D gets, the fault). Its ``on_peer`` is the
        caller's to time."""
        taken = self.take_fault(engine, request_id)
        if taken is None:
            return params, None
        fault, injector = taken
        if isinstance(injector, PairInjector) and injector.before_add is not None:
            params = injector.before_add(Arming(engine, pair, fault), params)
        return params, fault

    # ------------------------------------------------------------ adding requests

    #: When a fault on P's whole process (``on_peer``) happens: before D adds the
    #: requests (False), or once D added them (True: a driver whose fault waits for D's
    #: handshake, or must know whether D had talked to P before).
    on_peer_after_add: bool = False

    def _adding_to(self, engine: Engine) -> PeerPair:
        """The pair ``engine`` loads from, with a live P, about to get requests."""
        return self._live(self._pair_of(engine))

    def _prefill_batch(
        self, pair: PeerPair, request_ids: Sequence[str], prompt_len: int
    ) -> dict[str, dict[str, Any]]:
        """P's params for every request, prefilled in one command."""
        return pair.prefill_batch(request_ids, prompt_len, p_bound_s=self._prefill_bound_s())

    @staticmethod
    def _prefill_bound_s() -> float:
        """P's bound on one prefill command, in this machine's time: on a loaded machine
        P's earlier requests hold its blocks longer, and a batch that waits for them is
        the rig's delay, not a verdict."""
        return timebase.scaled(PREFILL_TIMEOUT_S)

    def _d_warm(self, engine: Engine, pair: PeerPair, producer: Any) -> bool | None:
        """Whether D had talked to ``producer`` before, for :attr:`OnPeer.warm` (None:
        this driver does not ask)."""
        return None

    def _hit_peer(
        self, on_peer: Callable[[OnPeer], None], call: OnPeer, add: Callable[[], None]
    ) -> None:
        """Run ``add`` (D adds the requests) and the fault on P's whole process, in the
        order :attr:`on_peer_after_add` says."""
        if not self.on_peer_after_add:
            on_peer(call)
        add()
        if self.on_peer_after_add:
            on_peer(call)

    def _add_to_d(self, batch: RemoteBatch, pair: PeerPair, request_id: str, params: Any) -> None:
        pair.add(
            request_id,
            params,
            prompt_len=batch.prompt_len,
            max_tokens=batch.max_tokens,
            consumer=batch.engine,
        )

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """P prefills; the armed fault's ``before_add`` breaks the params or tells P what
        to do, and its ``on_peer`` (one request: its P is the one that dies or stops)
        happens as :attr:`on_peer_after_add` says."""
        batch = RemoteBatch(engine, (request_id,), prompt_len=prompt_len, max_tokens=max_tokens)
        self.add_each(batch)
        return request_id

    def hits_whole_peer(self, fault: FaultPoint | None) -> bool:
        return self._on_peer(fault) is not None

    def add_each(self, batch: RemoteBatch) -> None:
        """P prefills the whole batch in one command (the round trip per request is what
        a soak of many loads paid for), then each request is armed and added as
        :meth:`add_remote_request` adds one: its fault set up before D adds it."""
        pair = self._adding_to(batch.engine)
        params = self._prefill_batch(pair, batch.request_ids, batch.prompt_len)
        for request_id in batch.request_ids:
            if batch.fault is not None:
                self.arm(batch.engine, request_id, batch.fault, ranks=batch.ranks)
            self._add_prefilled(batch, pair, request_id, params[request_id])

    def _add_prefilled(
        self, batch: RemoteBatch, pair: PeerPair, request_id: str, params: Any
    ) -> None:
        """Add one request P prefilled: the fault armed for it takes effect (its
        ``before_add``, then its ``on_peer`` on the pair's P for this request alone)."""
        params, fault = self._before_add(batch.engine, pair, request_id, params)
        on_peer = self._on_peer(None if fault is None else fault.point)
        if on_peer is None or fault is None:
            self._add_to_d(batch, pair, request_id, params)
            return
        producer = pair.producer()
        warm = self._d_warm(batch.engine, pair, producer)
        call = OnPeer(batch.engine, pair, producer, 0, [request_id], fault.point, warm, fault.ranks)
        self._hit_peer(on_peer, call, lambda: self._add_to_d(batch, pair, request_id, params))

    def add_from_peer(self, batch: RemoteBatch) -> None:
        """P (``peer`` 1: the pair's second P) prefills every request in one command,
        then a fault on that P itself (SIGKILL, SIGSTOP, a stall, one of its ranks
        killed) happens once for all of them, as :attr:`on_peer_after_add` says; the
        second P also serves plain loads (no fault)."""
        engine = batch.engine
        pair = self._adding_to(engine)
        if batch.peer == 0:
            params = self._prefill_batch(pair, batch.request_ids, batch.prompt_len)
            producer = pair.producer()  # after the prefill, which may have replaced P
        else:
            producer = self._peer_producer(pair, batch.peer, batch.fault)
            params = producer.prefill_batch(
                {rid: rid for rid in batch.request_ids},
                batch.prompt_len,
                p_bound_s=self._prefill_bound_s(),
            )

        def add() -> None:
            for request_id in batch.request_ids:
                self._add_to_d(batch, pair, request_id, params[request_id])

        on_peer = self._on_peer(batch.fault)
        if on_peer is None or batch.fault is None:
            add()
            return
        warm = self._d_warm(engine, pair, producer)
        rids = list(batch.request_ids)
        call = OnPeer(engine, pair, producer, batch.peer, rids, batch.fault, warm, batch.ranks)
        self._hit_peer(on_peer, call, add)

    def _kill_p_rank(self, call: OnPeer) -> None:
        """``tp_one_rank`` (and ``tp_one_rank_warm``): a real one-rank crash, the P rank
        the scenario names SIGKILLed after P prefilled every request, once for all of
        them; P's other ranks serve their shards. Which ranks a driver cannot kill alone
        it declares in its table (``not_alone``). The pair is replaced after the
        scenario."""
        self._signal_one_p_rank(call, signal.SIGKILL)

    def _freeze_p_rank(self, call: OnPeer) -> None:
        """``tp_one_rank_frozen``: the P rank the scenario names SIGSTOPped after P
        prefilled every request, once for all of them; P's other ranks serve their shards.
        :meth:`end_faults` lets it go on; the pair is replaced after the scenario."""
        rank = self._signal_one_p_rank(call, signal.SIGSTOP)
        self._frozen_ranks.setdefault(id(call.pair), set()).add(rank)

    def _signal_one_p_rank(self, call: OnPeer, sig: int) -> int:
        """Send ``sig`` to the one P rank ``call`` names, and mark its pair for replacement
        after the scenario; returns the rank."""
        if not call.ranks or len(call.ranks) != 1:
            raise ValueError(
                f"driver {self.name!r}: {call.point.value} needs one rank, not {call.ranks}"
            )
        call.pair.signal_p_rank(call.ranks[0], sig)
        self._broken.add(id(call.pair))
        return call.ranks[0]

    def _peer_producer(self, pair: PeerPair, peer: int, fault: FaultPoint | None) -> Any:
        """P number ``peer`` of ``pair``, ready: 0 is its P, 1 its second P (started now
        if it has none). The second P serves plain loads, or is killed (``kill_one_peer``)."""
        if peer == 0:
            return pair._ready_producer()
        if peer != 1:
            raise ValueError(f"{self.pair_name} has two P's (peer 0 and 1), not peer {peer}")
        if fault is not None and fault not in self.SECOND_P_FAULTS:
            raise ValueError(f"driver {self.name!r}: {fault} cannot be armed on the second P")
        return pair.second_p()

    def add_local_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        """A request D computes itself, watched by the pair's integrity oracle."""
        self._pair_of(engine).integrity.track(engine, request_id, request_id, prompt_len)
        return super().add_local_request(
            engine, request_id, prompt_len=prompt_len, max_tokens=max_tokens
        )

    def settle(
        self, engine: Engine, request_id: str, *, ranks: Iterable[int] | None = None
    ) -> None:
        """Nothing to do: a real pull completes on its own."""

    def verify_bytes(self, engine: Engine, request_id: str) -> str | None:
        rec = self._pair_of(engine).records.get(request_id)
        if rec is None:
            return f"{request_id} never ran after its load: no bytes were checked"
        return rec.bytes_mismatch()

    def wrong_bytes_finding(self, engine: Engine, request_id: str) -> str | None:
        rec = self._pair_of(engine).records.get(request_id)
        return None if rec is None else rec.wrong_bytes()

    def detection_s(self, engine: Engine, request_id: str) -> float | None:
        rec = self._pair_of(engine).records.get(request_id)
        return None if rec is None else rec.reported_s

    def integrity_findings(self, engine: Engine) -> list[str]:
        findings: list[str] = self._pair_of(engine).integrity_findings(engine)
        return findings
