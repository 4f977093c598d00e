"""The conformance driver for Mooncake: a real P process, each scenario's D a fresh engine.

:class:`MooncakeDriver` adapts :class:`kvfail.peers.mooncake.MooncakePair` to the Driver
API (see the class for the fault points it provokes and how).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfail.conformance.claims import DriverClaim, Probe
from kvfail.conformance.claims import probe as probe_of
from kvfail.conformance.driver import (
    LATE_WRITE_STEPS,
    Claim,
    Declared,
    LateWriteGate,
    abort_request,
)
from kvfail.conformance.pair_driver import Arming, OnPeer, PairDriver, PairInjector
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine

__all__ = [
    "BOOTSTRAP_ON_RANK_0",
    "MooncakeDriver",
    "make_driver",
    "make_upstream_driver",
    "mooncake_bases",
]

#: Why ``tp_one_rank`` cannot kill P's rank 0 alone: the reason a skip of that rank prints.
BOOTSTRAP_ON_RANK_0 = (
    "P's TP rank 0 also runs Mooncake's bootstrap server, which a cold D asks for every "
    "P rank's address: killing or stopping rank 0 fails every rank's load, not one"
)


@dataclass
class _LatePush:
    """A late-write fault's state (``slow_peer_past_deadline``, ``peer_shutdown_mid_write``):
    the P holding the write, whether the driver let it go, and what the write did once P
    says it happened."""

    producer: Any
    #: P was shut down gracefully: once its held write has landed, its shutdown is over
    #: and its process exits, as a vLLM engine's does when its shutdown returns.
    exits: bool = False
    #: Counted from the scenario's first ask (the load had stopped waiting).
    gate: LateWriteGate = field(default_factory=LateWriteGate)
    released: bool = False
    done: str | None = None

    def release(self, request_id: str) -> bool:
        """Let P's held write go (once); False while P could not be asked."""
        if not self.released:
            try:
                self.producer.release(request_id)
            except Exception:  # P busy or gone: asked again at the next poll
                return False
            self.released = True
        return True


class MooncakeDriver(PairDriver):
    """A real Mooncake P/D pair (``kvfail.peers.mooncake.MooncakePair``): P in its own OS
    process, each scenario's D a fresh ("cold") harness engine in this process.

    Every fault is real, on TCP loopback, and provoked before D adds the request (a pull
    starts in D's first step, right after, so nothing could be injected afterwards):

    * process faults on P: SIGKILL after P prefilled (``kill_before_pull``; D cold, or
      warm when the scenario pulled once first), SIGSTOP (``freeze_peer``, a silent P);
      SIGKILL of one P TP rank (``tp_one_rank``: rank 1 for a cold D, see
      :data:`BOOTSTRAP_ON_RANK_0`; ``tp_one_rank_warm``: any rank, D warm);
      SIGKILL one of two P processes D loads from at once (``kill_one_peer``: the pair's
      second P, a real process with its own bootstrap server, started for the scenario);
    * protocol faults answered by the real P process (``peer_error_response``,
      ``peer_err_reqs``, ``peer_finish_without_result``: see ``kvfail.peers.producer``);
    * network/params faults: a refused bootstrap address, an unknown engine id, a
      blackholed bootstrap proxy, malformed ``kv_transfer_params``;
    * a slow but live P (``net_delay``): P's sender sleeps :attr:`NET_DELAY_S` before it
      serves the pull for real, so the transfer and its reply come late (P-side, in the
      real process: a proxy in front of the bootstrap would delay only the lookup);
    * a slow P that writes after D gave the load up (``slow_peer_past_deadline``): P's
      sender holds the pull until the scenario, having seen the load fail, asks for the
      late write (:meth:`late_write_finding` lets it go some D steps later, then asks P
      whether each of its ranks pushed); P's own expiry is held off meanwhile, so P
      really pushes into D's blocks then, whatever D did (Mooncake is P-push: D has no
      handle on that write);
    * a P shut down gracefully while its write is under way (``peer_shutdown_mid_write``):
      each rank's connector runs its own shutdown as the write starts, and the write is
      held the same way (see ``kvfail.peers.producer``); once it has landed, P's process
      exits, its shutdown over.

    Why a release and not P's clock: a write timed to land some seconds after the pull
    races D's deadline, and on a loaded machine D's report can come after it; a
    connector that frees blocks too early would then pass. Released some D steps after D
    gave the load up, the write lands when it does the most harm, on any machine.
    * driver-side abort and empty pulls.

    P is shared across scenarios; after a scenario a frozen P is thawed and a killed one
    replaced (:meth:`after_scenario`, the new P's import overlapping the next D build).
    D's bytes are checked against P's pattern by the pair's forward hook.

    ``connector``/``connector_module`` pick D's connector: kvfail's (``connectors.mooncake``,
    ``--connector mooncake``), upstream's (``--connector vllm:MooncakeConnector``) or any
    ``MooncakeConnector`` subclass (``module:Class``, e.g. the negative controls). P runs
    ``p_connector``/``p_connector_module`` (default: the same as D).
    """

    #: How long a P whose shutdown is over may take to exit when asked, before the rig
    #: kills its group (its writes are over either way).
    SHUTDOWN_EXIT_S = 5.0

    pair_module = "kvfail.peers.mooncake"
    pair_name = "MooncakePair"
    #: Every (D's TP, groups, P's TP) of 1 or 2: P's TP may differ from D's (p2d1, p1d2).
    layouts = frozenset(itertools.product((1, 2), (1, 2), (1, 2)))
    #: The malformed ``kv_transfer_params`` this driver can build (see :meth:`malformed`).
    MALFORMED = ("missing_transfer_id", "bad_bootstrap_addr")

    def __init__(
        self,
        name: str = "mooncake",
        *,
        connector: str = "KvfailMooncakeConnector",
        connector_module: str | None = "connectors.mooncake",
        p_connector: str | None = None,
        p_connector_module: str | None = None,
    ) -> None:
        self._p_connector = p_connector
        self._p_module = p_connector_module
        self._late_polled = 0.0
        #: Bootstrap proxies by pair (``id``), made on first use, closed by the pair.
        self._proxies: dict[int, Any] = {}
        self._init_pair_driver(name, connector, connector_module)

    @staticmethod
    def _connector_bases() -> tuple[type, type | None] | None:
        return mooncake_bases()

    @classmethod
    def claims(cls, probe: Probe) -> DriverClaim | None:
        """A connector whose constructor builds a Mooncake ``TransferEngine`` (the P2P
        pull this pair serves). P runs the registered connector whose worker D builds
        (kvfail's, whose P answers kvfail's reply format, or upstream's): what speaks D's
        side of the wire, chosen by the transport D builds, never a verdict."""
        engines = probe.builds_from("mooncake")
        if not engines:
            return None
        upstream, ours = mooncake_bases() or (None, None)
        p: type | None = upstream
        if upstream is not None and ours is not None:
            extra = probe_of(ours).built - probe_of(upstream).built
            if extra and extra <= probe.built:
                p = ours
        # None: P runs D's own class, named as D's is (the registered drivers' way).
        p_side = (None, None) if p is None or p is probe.cls else (p.__name__, p.__module__)
        if p is upstream and p_side[0] is not None:
            p_side = ("MooncakeConnector", None)  # upstream's by its registry name
        d_cls, d_module = probe.d_side
        why = (
            f"builds {', '.join(c.__qualname__ for c in engines)} (Mooncake P2P pull); "
            f"P runs {p_side[0] or d_cls}"
        )
        return DriverClaim(
            why,
            lambda name: cls(
                name,
                connector=d_cls,
                connector_module=d_module,
                p_connector=p_side[0],
                p_connector_module=p_side[1],
            ),
        )

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int, p_tp_size: int) -> Any:
        """A pair of this layout; P is shared by the drivers of a session that want the
        same P connector and P layout (P's TP size: a P pairs with D's of any TP size)."""
        from kvfail.peers.mooncake import MooncakePair

        if self._p_connector is not None:
            p_side: list[Any] = [self._p_connector, self._p_module]
        else:  # P runs D's connector (as MooncakePair decides)
            p_side = [self._connector, self._module]
        pair, _key = self._pair_sharing_p(
            [*p_side, p_tp_size, num_kv_cache_groups],
            lambda shared: MooncakePair(
                policy="fail",
                connector=self._connector,
                connector_module=self._module,
                p_connector=self._p_connector,
                p_connector_module=self._p_module,
                tp_size=tp_size,
                p_tp_size=p_tp_size,
                num_kv_cache_groups=num_kv_cache_groups,
                abort_request_timeout_s=5,
                ready_timeout_s=180.0,
                producer=shared,
            ),
        )
        return pair

    def _p_replaced(self, pair: Any) -> None:
        self._proxies.pop(id(pair), None)  # the proxy fronted the old P's bootstrap port

    def stop(self) -> None:
        self._proxies.clear()  # closed by their pairs
        super().stop()

    @property
    def injectors(self) -> dict[FaultPoint, PairInjector]:
        from kvfail.peers.mooncake import refused_bootstrap, unknown_engine

        kill = PairInjector(on_peer=_kill)  # the P the requests come from dies
        return {
            # Protocol faults answered by the real P process (kvfail.peers.producer).
            FaultPoint.PEER_ERROR_RESPONSE: PairInjector(before_add=_p_does("error_response")),
            FaultPoint.PEER_ERR_REQS: PairInjector(before_add=_p_does("err_reqs")),
            FaultPoint.PEER_FINISH_WITHOUT_RESULT: PairInjector(
                before_add=_p_does("finish_without_result")
            ),
            FaultPoint.NET_DELAY: PairInjector(before_add=_p_does("delay", self.NET_DELAY_S)),
            FaultPoint.SLOW_PEER_PAST_DEADLINE: PairInjector(before_add=self._late_push),
            FaultPoint.PEER_SHUTDOWN_MID_WRITE: PairInjector(before_add=self._shutdown_mid_write),
            FaultPoint.KILL_BEFORE_PULL: kill,
            FaultPoint.KILL_ONE_PEER: kill,
            FaultPoint.KILL_DURING_TRANSFER: PairInjector(before_add=self._die_mid_transfer),
            # One P rank SIGKILLed, the others serve. A cold D asks P's bootstrap server
            # (in P's rank 0) for every rank's address, so rank 0 dies alone only for a
            # D that has loaded from P already (tp_one_rank_warm).
            FaultPoint.TP_ONE_RANK: PairInjector(
                on_peer=self._kill_p_rank, not_alone={0: BOOTSTRAP_ON_RANK_0}
            ),
            FaultPoint.TP_ONE_RANK_WARM: PairInjector(on_peer=self._kill_p_rank),
            # A stopped rank 0 would stop P's bootstrap server for a cold D too.
            FaultPoint.TP_ONE_RANK_FROZEN: PairInjector(
                on_peer=self._freeze_p_rank, not_alone={0: BOOTSTRAP_ON_RANK_0}
            ),
            FaultPoint.FREEZE_PEER: PairInjector(on_peer=_freeze),
            # Network and params faults: D is sent where P is not, or is not answered.
            FaultPoint.REFUSE: PairInjector(before_add=lambda _, p: refused_bootstrap(p)),
            FaultPoint.UNKNOWN_ENGINE: PairInjector(before_add=lambda _, p: unknown_engine(p)),
            FaultPoint.NET_BLACKHOLE: PairInjector(before_add=self._blackhole),
            # Driver-side: the scenario aborts, or adds a request with no block to load.
            FaultPoint.ABORT_WHILE_WAITING: PairInjector(provoke=abort_request),
            FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS: PairInjector(),
        }

    def end_faults(self, engine: Engine) -> None:
        """A late write still held goes now, so the blocks it holds on D can come back."""
        for fault in self.handle(engine).active.values():
            if isinstance(fault.state, _LatePush):
                fault.state.release(fault.request_id)
        super().end_faults(engine)

    def _late_push(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        """``slow_peer_past_deadline``: P's sender holds the pull until released, then
        pushes and answers."""
        arming.pair.inject(arming.fault.request_id, "delay", delay_s=self.LATE_WRITE_CAP_S)
        arming.fault.state = _LatePush(arming.pair.p)
        return params

    def _shutdown_mid_write(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        """``peer_shutdown_mid_write``: each P rank shuts its connector down as its write
        for the pull starts, and the write lands once released; then P's process exits
        (:meth:`late_write_finding`). The pair is replaced after the scenario."""
        arming.pair.inject(
            arming.fault.request_id, "shutdown_mid_write", delay_s=self.LATE_WRITE_CAP_S
        )
        arming.fault.state = _LatePush(arming.pair.p, exits=True)
        self._broken.add(id(arming.pair))
        return params

    def _die_mid_transfer(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        """P's sender really writes half of the pull into D, then SIGKILLs itself."""
        arming.pair.inject(arming.fault.request_id, "die_mid_transfer")
        self._broken.add(id(arming.pair))
        return params

    def _blackhole(self, arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        """D's bootstrap query goes through a proxy that swallows it, connection open."""
        from kvfail.faults import ProxyMode

        pair: Any = arming.pair
        proxy = self._proxies.get(id(pair))
        if proxy is None:
            proxy = self._proxies[id(pair)] = pair.bootstrap_proxy()
        proxy.set_mode(ProxyMode.BLACKHOLE)
        return dict(pair.via_proxy(params, proxy))

    def declared(self) -> Declared:
        return Declared(
            async_load=Claim(True, "Mooncake pulls asynchronously"),
            sync_load=Claim(False, "Mooncake only advertises asynchronous loads"),
            remote_prefill=Claim(True, "a real P process prefills and serves the pull"),
            two_groups=Claim(
                True,
                "P and D both built with two KV-cache groups (MooncakeConnector is SupportsHMA)",
            ),
            real_transport=Claim(True, "Mooncake TransferEngine over TCP loopback"),
            tp2=Claim(
                True,
                "P and D each run two TP rank processes in a real gloo world (tp_mode=processes)",
            ),
            hetero_tp=Claim(
                True,
                "P runs its own TP size (p2d1, p1d2); D's connector pairs its ranks with P's "
                "from the handshake's TP sizes, as in production",
            ),
        )

    @staticmethod
    def malformed(params: dict[str, Any], kind: str) -> dict[str, Any]:
        """P's real ``kv_transfer_params`` with one field broken."""
        out = dict(params)
        if kind == "missing_transfer_id":
            out.pop("transfer_id", None)
        elif kind == "bad_bootstrap_addr":
            out["remote_bootstrap_addr"] = "127.0.0.1:not-a-port"
        else:
            raise ValueError(f"unknown malformation {kind!r}")
        return out

    def add_malformed_request(
        self, engine: Engine, request_id: str, kind: str, *, prompt_len: int = 100
    ) -> str:
        """Add a request whose params P produced but one field is broken (``MALFORMED``)."""
        pair = self._live(self._pair_of(engine))
        params = self.malformed(pair.prefill(request_id, prompt_len), kind)
        pair.add(request_id, params, prompt_len=prompt_len, max_tokens=3, consumer=engine)
        return request_id

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        """The scenario asks once D gave the load up: :data:`LATE_WRITE_STEPS` D steps
        later P's held write for ``request_id`` goes, then whether it ran on every P rank
        (asked of P at most every :attr:`LATE_POLL_S`), and which ranks' push wrote
        into D."""
        fault = self.handle(engine).active.get(request_id)
        late = None if fault is None else fault.state
        if not isinstance(late, _LatePush):
            return None
        if late.done is not None:
            return late.done
        if not late.gate.due(engine.record.steps):
            return None
        producer = late.producer
        now = time.monotonic()
        if now - self._late_polled < self.LATE_POLL_S:
            return None
        self._late_polled = now
        if not producer.process.alive or producer.process.frozen:
            return None
        if not late.release(request_id):
            return None
        try:
            pushes = producer.late_pushes()
        except Exception:  # P busy or gone: asked again at the next poll, within the bound
            return None
        pushed = pushes["pushed"].get(request_id, [])
        if len(pushed) < len(engine.workers):
            return None
        written = pushes["written"].get(request_id, [])
        late.done = (
            f"P pushed {request_id} once released, {LATE_WRITE_STEPS} D steps after D gave "
            "the load up; the push "
            f"wrote into D on rank(s) {written} of {sorted(pushed)}"
        )
        if late.exits:
            # The shutdown's last write is over, so its process ends, as vLLM's engine
            # process does once shutdown returns: a P that shut down does not linger.
            # What may then prove the write over to D is P's own evidence or its exit.
            producer.close(timeout_s=self.SHUTDOWN_EXIT_S)
            late.done += "; then P's process exited, its shutdown over"
        return late.done


def _p_does(kind: str, delay_s: float | None = None) -> Any:
    """A ``before_add`` telling the real P to answer the pull with ``kind``
    (:mod:`kvfail.peers.producer`); ``delay_s``: P's sender sleeps that long first."""

    def before_add(arming: Arming, params: dict[str, Any]) -> dict[str, Any]:
        extra = {} if delay_s is None else {"delay_s": delay_s}
        arming.pair.inject(arming.fault.request_id, kind, **extra)  # type: ignore[attr-defined]
        return params

    return before_add


def _kill(call: OnPeer) -> None:
    """SIGKILL the P the requests come from (the pair's P, or its second P)."""
    pair: Any = call.pair
    if call.peer == 0:
        pair.kill_p()
    else:
        pair.kill_second_p()


def _freeze(call: OnPeer) -> None:
    """SIGSTOP the pair's P: its sockets stay open, nothing answers."""
    call.pair.freeze_p()


def mooncake_bases() -> tuple[type, type | None] | None:
    """(upstream ``MooncakeConnector``, kvfail's connector or None), None without Mooncake."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeConnector,
        )
    except Exception:
        return None
    try:
        from connectors.mooncake import KvfailMooncakeConnector
    except Exception:
        return MooncakeConnector, None
    return MooncakeConnector, KvfailMooncakeConnector


def make_driver(name: str) -> MooncakeDriver:
    """Entry point ``kvfail.drivers`` ``mooncake``: kvfail's connector on D."""
    return MooncakeDriver(name)


def make_upstream_driver(name: str) -> MooncakeDriver:
    """Entry point ``vllm:MooncakeConnector``: upstream's connector on the same real pair
    (not the generic driver, so its deadline is real)."""
    return MooncakeDriver(name, connector="MooncakeConnector", connector_module=None)
