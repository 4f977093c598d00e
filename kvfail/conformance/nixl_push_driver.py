"""The conformance driver for NIXL *push* mode (``--connector nixl-push``).

Why its own driver: in push mode P WRITEs into D's blocks once D's registration reaches
it, so the faults that are real differ from pull mode, and D must serve its own side
channel (:class:`kvfail.peers.nixl_push.NixlPushPair`). Everything else (P as a real
zygote-forked process, D a fresh harness engine per scenario, the integrity oracle, the
late-write digests) is :class:`~kvfail.conformance.nixl_driver.NixlDriver`'s.

P runs upstream's ``NixlPushConnector``; D runs kvfail's ``KvfailNixlPushConnector``
(or, through :meth:`NixlPushDriver.for_class`, any ``NixlPushConnector`` subclass; the
entry point ``nixl-push:upstream`` runs upstream's D). TP 1, one KV-cache group only.

Fault points advertised, each real here:

* ``freeze_peer``: P stopped after both handshakes (a warm D); D's registration waits in
  P's socket buffer, P writes nothing; only D's deadline ends the load;
* ``slow_peer_past_deadline``: P stopped likewise and continued after D's deadline; it
  then reads the registration and WRITEs into the blocks D gave the load (the digests
  of :class:`~kvfail.conformance.nixl_driver.NixlDriver` say where it landed);
* ``net_delay``: the same stall, shorter than the deadline: the WRITE lands in time;
* ``kill_before_pull``: P stopped, then SIGKILLed before it ever wrote;
* ``refuse`` / ``unknown_engine``: D's registration handshake cannot reach the P it names;
* ``abort_while_waiting`` (driver-side).

Not advertised: ``notify_failed`` (in push mode D sends P no done-notification; P's
completion rides on its WRITE), ``peer_bad_metadata`` / ``peer_metadata_mismatch`` (D's
handshake with P loads notification agents only, and P's layout is checked by P when it
handshakes with D: a D-side scenario would test P), ``kill_one_peer`` and the TP layouts
(not built for push).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvfail.conformance.driver import Declared
from kvfail.conformance.nixl_driver import NixlDriver, _KillOnProvoke, _LateRead
from kvfail.conformance.pair_driver import register_producer, shared_producer
from kvfail.faults.points import FaultPoint

__all__ = ["NixlPushDriver", "make_driver", "make_upstream_driver", "push_base"]


def push_base() -> type | None:
    """Upstream's ``NixlPushConnector`` class, None without NIXL/vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPushConnector,
        )
    except Exception:
        return None
    return NixlPushConnector


class _LateWrite(_LateRead):
    """A ``slow_peer_past_deadline`` push: the digests are the pull driver's, the words
    say what happened in push mode (P's WRITE, not D's READ)."""

    def settle(self, before: list[str], delay_s: float) -> None:
        where, seen = self.changed_since(before)
        self.done = (
            f"P, stopped with D's registration unread, went on {delay_s:g} s after D added "
            f"the load; in the {NixlDriver.LATE_SETTLE_S:g} s after, while D did not step "
            f"(only P's WRITE could write), the load's blocks changed {where}{seen}"
        )


class NixlPushDriver(NixlDriver):
    """A real NIXL push pair (see the module docstring)."""

    pair_module = "kvfail.peers.nixl_push"
    pair_name = "NixlPushPair"
    layouts = frozenset({(1, 1)})
    PEER_WIDE = frozenset(
        {
            FaultPoint.KILL_BEFORE_PULL,
            FaultPoint.FREEZE_PEER,
            FaultPoint.NET_DELAY,
            FaultPoint.SLOW_PEER_PAST_DEADLINE,
        }
    )
    KILLS = frozenset({FaultPoint.KILL_BEFORE_PULL})

    def __init__(
        self,
        name: str = "nixl-push",
        *,
        connector: str = "KvfailNixlPushConnector",
        connector_module: str | None = "connectors.nixl",
    ) -> None:
        super().__init__(name, connector=connector, connector_module=connector_module)

    def _new_pair(self, tp_size: int, num_kv_cache_groups: int) -> Any:
        """A push pair; its P (upstream's push connector) is shared by every push driver
        of the session, never with the pull drivers (P's transfer mode is part of its
        compatibility hash)."""
        from kvfail.peers.nixl_push import NixlPushPair

        key = json.dumps(["nixl-push-P", tp_size, num_kv_cache_groups])
        shared = shared_producer(key)
        pair = NixlPushPair(
            connector=self._connector,
            connector_module=self._module,
            ready_timeout_s=240.0,
            build_default_consumer=False,
            producer=shared,
        )
        pair.kvfail_share_key = key
        if shared is None:
            register_producer(key, pair.p)
        self._warm_p(pair)
        return pair

    def _fault_on_peer(
        self,
        engine: Any,
        pair: Any,
        producer: Any,
        request_ids: Sequence[str],
        fault: FaultPoint,
        warm: bool,
    ) -> None:
        """Freeze or kill P at once, before D steps, warm D or cold.

        Why not after D's handshake, as in pull mode: a push D sends its registration as
        soon as its handshake ends, and P WRITEs right away, so a fault injected after
        the handshake races the very write it means to stop. A cold D's handshake with
        a stopped or dead P never ends (the load fails; nothing was registered). A warm
        D's registration waits, unread, in a stopped P's socket buffer; for a kill, P is
        stopped now and killed by ``provoke`` (so it dies holding the registration)."""
        if fault is FaultPoint.SLOW_PEER_PAST_DEADLINE:
            if not warm:
                raise RuntimeError(
                    f"NixlPushDriver: {fault.value} needs a warm D (one push from P first): "
                    "a cold D's handshake with the stopped P outlasts its deadline, so its "
                    "registration is never sent and nothing could be written late"
                )
            self._delay(producer, self.slow_peer_delay_s)
            for rid in request_ids:
                self._on_peer(engine, [rid], fault, _LateWrite(producer, engine))
        elif fault is FaultPoint.FREEZE_PEER:
            producer.process.freeze()
        elif fault in self.KILLS and warm:
            producer.process.freeze()
            self._on_peer(engine, request_ids, fault, _KillOnProvoke(producer))
        elif fault in self.KILLS:
            producer.process.kill(timeout_s=pair.kill_timeout_s)
        else:
            super()._fault_on_peer(engine, pair, producer, request_ids, fault, warm)

    @property
    def faults(self) -> frozenset[FaultPoint]:
        return frozenset(
            {
                FaultPoint.KILL_BEFORE_PULL,
                FaultPoint.FREEZE_PEER,
                FaultPoint.NET_DELAY,
                FaultPoint.SLOW_PEER_PAST_DEADLINE,
                FaultPoint.REFUSE,
                FaultPoint.UNKNOWN_ENGINE,
                FaultPoint.ABORT_WHILE_WAITING,
            }
        )

    def declared(self) -> Declared:
        return {
            "async_load": (True, "P WRITEs asynchronously; D polls its notifications each step"),
            "sync_load": (False, "NIXL only advertises asynchronous loads"),
            "remote_prefill": (True, "a real P process prefills and WRITEs into D's blocks"),
            "two_groups": (False, "the push pair is built with one KV-cache group"),
            "real_transport": (True, "nixl agent, UCX over TCP loopback, DRAM"),
            "tp2": (False, "the push pair runs TP 1 only"),
            "byte_verification": (True, "D's pushed blocks are compared with P's pattern"),
            "malformed_params": (
                False,
                "the suite's malformations name Mooncake fields; NIXL's bad params are "
                "unknown_engine / refuse",
            ),
        }


def make_driver(name: str) -> NixlPushDriver:
    """Entry point ``kvfail.drivers`` ``nixl-push``: kvfail's push connector on D."""
    return NixlPushDriver(name)


def make_upstream_driver(name: str) -> NixlPushDriver:
    """Entry point ``nixl-push:upstream``: upstream's ``NixlPushConnector`` on D, the
    same pair and faults (its findings are upstream's, not a gate)."""
    return NixlPushDriver(name, connector="NixlPushConnector", connector_module=None)
