"""The conformance driver for Mooncake: a real P process, each scenario's D a fresh engine.

:class:`MooncakeDriver` adapts :class:`kvfail.peers.mooncake.MooncakePair` to the Driver
API (see the class for the fault points it provokes and how).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfail.conformance.driver import Declared
from kvfail.conformance.pair_driver import PairDriver, register_producer, shared_producer
from kvfail.faults.points import FaultPoint

if TYPE_CHECKING:
    from kvfail.harness.engine import Engine

__all__ = ["MooncakeDriver", "make_driver", "make_upstream_driver", "mooncake_bases"]


@dataclass
class _LatePush:
    """A ``slow_peer_past_deadline`` fault's state: the P armed to push late, and what its
    push did once P says it happened."""

    producer: Any
    done: str | None = None


class MooncakeDriver(PairDriver):
    """A real Mooncake P/D pair (``kvfail.peers.mooncake.MooncakePair``): P in its own OS
    process, each scenario's D a fresh ("cold") harness engine in this process.

    Every fault is real, on TCP loopback, and provoked before D adds the request (a pull
    starts in D's first step, right after, so nothing could be injected afterwards):

    * process faults on P: SIGKILL after P prefilled (``kill_before_pull``; D cold, or
      warm when the scenario pulled once first), SIGSTOP (``freeze_peer``, a silent P);
      SIGKILL one of two P processes D loads from at once (``kill_one_peer``: the pair's
      second P, a real process with its own bootstrap server, started for the scenario);
    * protocol faults answered by the real P process (``peer_error_response``,
      ``peer_err_reqs``, ``peer_finish_without_result``: see ``kvfail.peers.producer``);
    * network/params faults: a refused bootstrap address, an unknown engine id, a
      blackholed bootstrap proxy, malformed ``kv_transfer_params``;
    * a slow but live P (``net_delay``): P's sender sleeps :attr:`NET_DELAY_S` before it
      serves the pull for real, so the transfer and its reply come late (P-side, in the
      real process: a proxy in front of the bootstrap would delay only the lookup);
    * a slow P that writes after D's deadline (``slow_peer_past_deadline``): the same,
      for :attr:`slow_peer_delay_s` (the deadline the scenario asks D for, plus
      :attr:`SLOW_PEER_PAST_S`); P's own expiry is held off meanwhile, so P really
      pushes into D's blocks then, whatever D did (Mooncake is P-push: D has no handle
      on that write). :meth:`late_write_finding` asks P whether each of its ranks pushed;
    * driver-side abort and empty pulls.

    P is shared across scenarios; after a scenario a frozen P is thawed and a killed one
    replaced (:meth:`after_scenario`, the new P's import overlapping the next D build).
    D's bytes are checked against P's pattern by the pair's forward hook.

    ``connector``/``connector_module`` pick D's connector: kvfail's (``connectors.mooncake``,
    ``--connector mooncake``), upstream's (``--connector vllm:MooncakeConnector``) or any
    ``MooncakeConnector`` subclass (``module:Class``, e.g. the negative controls). P runs
    ``p_connector``/``p_connector_module`` (default: the same as D).
    """

    pair_module = "kvfail.peers.mooncake"
    pair_name = "MooncakePair"
    layouts = frozenset({(1, 1), (2, 1), (1, 2), (2, 2)})
    #: The malformed ``kv_transfer_params`` this driver can build (see :meth:`malformed`).
    MALFORMED = ("missing_transfer_id", "bad_bootstrap_addr")
    #: Faults on P's whole process: one event for every request in flight from it.
    PEER_WIDE = frozenset(
        {FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER, FaultPoint.FREEZE_PEER}
    )

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

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int) -> Any:
        """A pair whose P has this layout; P is shared by the drivers of a session that
        want the same P connector and layout."""
        from kvfail.peers.mooncake import MooncakePair

        if self._p_connector is not None:
            p_side: list[Any] = [self._p_connector, self._p_module]
        else:  # P runs D's connector (as MooncakePair decides)
            p_side = [self._connector, self._module]
        key = json.dumps([*p_side, tp_size, num_kv_cache_groups])
        shared = shared_producer(key)
        pair = MooncakePair(
            policy="fail",
            connector=self._connector,
            connector_module=self._module,
            p_connector=self._p_connector,
            p_connector_module=self._p_module,
            tp_size=tp_size,
            num_kv_cache_groups=num_kv_cache_groups,
            abort_request_timeout_s=5,
            ready_timeout_s=180.0,
            producer=shared,
        )
        if shared is None:
            register_producer(key, pair.p)
        return pair

    def _p_replaced(self, pair: Any) -> None:
        self._proxies.pop(id(pair), None)  # the proxy fronted the old P's bootstrap port

    def stop(self) -> None:
        self._proxies.clear()  # closed by their pairs
        super().stop()

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.PEER_ERROR_RESPONSE,
                FaultPoint.PEER_ERR_REQS,
                FaultPoint.PEER_FINISH_WITHOUT_RESULT,
                FaultPoint.KILL_BEFORE_PULL,
                FaultPoint.KILL_DURING_TRANSFER,
                FaultPoint.KILL_ONE_PEER,
                FaultPoint.FREEZE_PEER,
                FaultPoint.REFUSE,
                FaultPoint.UNKNOWN_ENGINE,
                FaultPoint.NET_BLACKHOLE,
                FaultPoint.NET_DELAY,
                FaultPoint.SLOW_PEER_PAST_DEADLINE,
                FaultPoint.ABORT_WHILE_WAITING,
                FaultPoint.NOTIFY_ONLY_EMPTY_BLOCKS,
                FaultPoint.TP_ONE_RANK,
            }
        )

    def declared(self) -> Declared:
        return {
            "async_load": (True, "Mooncake pulls asynchronously"),
            "sync_load": (False, "Mooncake only advertises asynchronous loads"),
            "remote_prefill": (True, "a real P process prefills and serves the pull"),
            "two_groups": (
                True,
                "P and D both built with two KV-cache groups (MooncakeConnector is SupportsHMA)",
            ),
            "real_transport": (True, "Mooncake TransferEngine over TCP loopback"),
            "tp2": (
                True,
                "P and D each run two TP rank processes in a real gloo world (tp_mode=processes)",
            ),
            "byte_verification": (True, "D's pulled blocks are compared with P's pattern"),
            "malformed_params": (
                True,
                "P's real params, one field broken: " + ", ".join(self.MALFORMED),
            ),
        }

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
        self.arm(engine, request_id, kind)
        return self.add_remote_request(engine, request_id, prompt_len=prompt_len)

    def add_remote_request(
        self, engine: Engine, request_id: str, *, prompt_len: int = 100, max_tokens: int = 3
    ) -> str:
        from kvfail.faults import ProxyMode
        from kvfail.peers.mooncake import refused_bootstrap, unknown_engine

        pair = self._live(self._pair_of(engine))
        params = pair.prefill(request_id, prompt_len)
        fault = self.handle(engine).take_fault(request_id)
        point = None if fault is None else fault.point
        if isinstance(point, str) and not isinstance(point, FaultPoint):
            params = self.malformed(params, point)
        elif point is FaultPoint.REFUSE:
            params = refused_bootstrap(params)
        elif point is FaultPoint.UNKNOWN_ENGINE:
            params = unknown_engine(params)
        elif point is FaultPoint.NET_BLACKHOLE:
            proxy = self._proxies.get(id(pair))
            if proxy is None:
                proxy = self._proxies[id(pair)] = pair.bootstrap_proxy()
            proxy.set_mode(ProxyMode.BLACKHOLE)
            params = pair.via_proxy(params, proxy)
        elif point is FaultPoint.PEER_ERROR_RESPONSE:
            pair.inject(request_id, "error_response")
        elif point is FaultPoint.PEER_ERR_REQS:
            pair.inject(request_id, "err_reqs")
        elif point is FaultPoint.PEER_FINISH_WITHOUT_RESULT:
            pair.inject(request_id, "finish_without_result")
        elif point is FaultPoint.NET_DELAY:
            pair.inject(request_id, "delay", delay_s=self.NET_DELAY_S)
        elif point is FaultPoint.SLOW_PEER_PAST_DEADLINE:
            pair.inject(request_id, "delay", delay_s=self.slow_peer_delay_s)
            assert fault is not None
            fault.state = _LatePush(pair.p)
        elif point in (FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER):
            pair.kill_p()  # one request: its P is the one that dies
        elif point is FaultPoint.KILL_DURING_TRANSFER:
            # P's sender really writes half of the pull into D, then SIGKILLs itself.
            pair.inject(request_id, "die_mid_transfer")
            self._broken.add(id(pair))
        elif point is FaultPoint.TP_ONE_RANK:
            # A real one-rank crash: P's TP rank 1 is SIGKILLed, rank 0 serves its pull.
            # (Rank 1: P's rank 0 also hosts Mooncake's bootstrap server, so killing it
            # would fail every rank's query, not one rank's transfer.)
            pair.signal_p_rank(1, signal.SIGKILL)
            self._broken.add(id(pair))
        elif point is FaultPoint.FREEZE_PEER:
            pair.freeze_p()
        pair.add(
            request_id,
            params,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            consumer=engine,
        )
        return request_id

    def add_remote_requests(
        self,
        engine: Engine,
        request_ids: Sequence[str],
        *,
        fault: FaultPoint | None = None,
        prompt_len: int = 100,
        max_tokens: int = 3,
        peer: int = 0,
    ) -> list[str]:
        """P (``peer`` 1: the pair's second P) prefills every request, then a fault on
        that P itself (SIGKILL, SIGSTOP) happens once, then D adds them all; other faults
        are armed per request (see the base), on the driver's P only."""
        if peer == 0 and fault not in self.PEER_WIDE:
            return super().add_remote_requests(
                engine, request_ids, fault=fault, prompt_len=prompt_len, max_tokens=max_tokens
            )
        pair = self._live(self._pair_of(engine))
        producer = self._peer_producer(pair, peer, fault)
        params = {rid: producer.prefill(rid, prompt_len, rid) for rid in request_ids}
        if fault in (FaultPoint.KILL_BEFORE_PULL, FaultPoint.KILL_ONE_PEER):
            if peer == 0:
                pair.kill_p()
            else:
                pair.kill_second_p()
        elif fault is FaultPoint.FREEZE_PEER:
            pair.freeze_p()
        for rid, rid_params in params.items():
            pair.add(
                rid,
                rid_params,
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                consumer=engine,
            )
        return list(request_ids)

    def provoke(
        self,
        engine: Engine,
        request_id: str,
        point: FaultPoint,
        *,
        ranks: Iterable[int] | None = None,
        block_index: int | None = None,
    ) -> None:
        if point is FaultPoint.ABORT_WHILE_WAITING:
            engine.abort(request_id)
        # The others were armed before the request was added (see arm()).

    def late_write_finding(self, engine: Engine, request_id: str) -> str | None:
        """Whether P's delayed push for ``request_id`` ran on every P rank (asked of P
        at most every :attr:`LATE_POLL_S`); then which ranks' push wrote into D."""
        fault = self.handle(engine).active.get(request_id)
        late = None if fault is None else fault.state
        if not isinstance(late, _LatePush):
            return None
        if late.done is not None:
            return late.done
        producer = late.producer
        now = time.monotonic()
        if now - self._late_polled < self.LATE_POLL_S:
            return None
        self._late_polled = now
        if not producer.process.alive or producer.process.frozen:
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
            f"P pushed {request_id} {self.slow_peer_delay_s:g} s after the pull; the push "
            f"wrote into D on rank(s) {written} of {sorted(pushed)}"
        )
        return late.done


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
