"""The conformance driver for NIXL *push* mode (``--connector nixl-push``).

Why its own driver: in push mode P WRITEs into D's blocks once D's registration reaches
it, so the faults that are real differ from pull mode, and D must serve its own side
channel (:class:`kvfail.peers.nixl_push.NixlPushPair`). Everything else (P as a real
zygote-forked process, D a fresh harness engine per scenario, the integrity oracle, the
late-write digests) is :class:`~kvfail.conformance.nixl_driver.NixlDriver`'s.

P runs upstream's ``NixlPushConnector``; D runs kvfail's ``KvfailNixlPushConnector``
(or, through :meth:`NixlPushDriver.for_class`, any ``NixlPushConnector`` subclass; the
entry point ``nixl-push:upstream`` runs upstream's D).

Fault points advertised, each real here:

* ``freeze_peer``: P stopped after both handshakes (a warm D); D's registration waits in
  P's socket buffer, P writes nothing; only D's deadline ends the load;
* ``slow_peer_past_deadline``: P stopped likewise and continued some D steps after D gave
  the load up (as in pull mode); it then reads the registration and WRITEs into the
  blocks D gave the load (the digests of
  :class:`~kvfail.conformance.nixl_driver.NixlDriver` say where it landed);
* ``net_delay``: the same stall, shorter than the deadline: the WRITE lands in time;
* ``kill_before_pull``: P stopped, then SIGKILLed before it ever wrote;
* ``refuse`` / ``unknown_engine``: D's registration handshake cannot reach the P it names;
* ``abort_while_waiting`` (driver-side);
* ``tp_one_rank``: one P rank SIGKILLed after P prefilled; the rest of P dies with it, as
  vLLM's executor makes it (see :meth:`NixlPushDriver._executor_reaps_p`);
* ``tp_one_rank_frozen``: one P rank SIGSTOPped; its share is never written until it
  goes on, so only D's deadline ends the load.

Not advertised: ``notify_failed`` (in push mode D sends P no done-notification; P's
completion rides on its WRITE), ``peer_bad_metadata`` / ``peer_metadata_mismatch`` (D's
handshake with P loads notification agents only, and P's layout is checked by P when it
handshakes with D: a D-side scenario would test P) and ``kill_one_peer``. Every layout of
the pull driver is built, two KV-cache groups and P at another TP size included.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvfail.conformance.driver import Claim, Declared, Provocation
from kvfail.conformance.nixl_driver import NixlDriver
from kvfail.conformance.nixl_fault_state import KillOnProvoke, LateRead
from kvfail.conformance.pair_driver import OnPeer, PairInjector
from kvfail.faults.points import FaultPoint

__all__ = ["NixlPushDriver", "make_driver", "make_upstream_driver"]


class _LateWrite(LateRead):
    """A ``slow_peer_past_deadline`` push: the digests are the pull driver's, the words
    say what happened in push mode (P's WRITE, not D's READ)."""

    def settle(self, before: list[str], went_on: str) -> None:
        where, seen = self.changed_since(before)
        self.done = (
            f"P, stopped with D's registration unread, went on {went_on}; "
            f"in the {NixlDriver.LATE_SETTLE_S:g} s after, while D did not step "
            f"(only P's WRITE could write), the load's blocks changed {where}{seen}"
        )


class NixlPushDriver(NixlDriver):
    """A real NIXL push pair (see the module docstring)."""

    pair_module = "kvfail.peers.nixl_push"
    pair_name = "NixlPushPair"
    #: Shared by every push driver of the session, never with the pull drivers.
    P_KEY = "nixl-push-P"
    MOVES_BLOCKS_BY = "_send_registration_to_p"
    MODE = "push: D registers its blocks, P WRITEs them"

    def __init__(
        self,
        name: str = "nixl-push",
        *,
        connector: str = "KvfailNixlPushConnector",
        connector_module: str | None = "connectors.nixl",
    ) -> None:
        super().__init__(name, connector=connector, connector_module=connector_module)

    @property
    def injectors(self) -> dict[FaultPoint, PairInjector]:
        """Pull mode's, where push is the same (a stall, a params fault, an abort); P's
        kill, stop and late write come at once, before D steps (see :meth:`_late_write`)."""
        pull = super().injectors
        same = (
            FaultPoint.NET_DELAY,
            FaultPoint.REFUSE,
            FaultPoint.UNKNOWN_ENGINE,
            FaultPoint.ABORT_WHILE_WAITING,
            FaultPoint.TP_ONE_RANK,
            FaultPoint.TP_ONE_RANK_FROZEN,
        )
        return {
            **{point: pull[point] for point in same},
            FaultPoint.KILL_BEFORE_PULL: PairInjector(
                on_peer=self._kill_at_once, provoke=self._kill_stopped_p
            ),
            FaultPoint.FREEZE_PEER: PairInjector(on_peer=_freeze_at_once),
            FaultPoint.SLOW_PEER_PAST_DEADLINE: PairInjector(on_peer=self._late_write),
            FaultPoint.TP_ONE_RANK: PairInjector(
                on_peer=self._kill_p_rank, provoke=self._executor_reaps_p
            ),
        }

    def _executor_reaps_p(self, call: Provocation) -> None:
        """``tp_one_rank`` in push mode: once one P rank is dead, the rest of P dies too,
        as vLLM's ``MultiprocExecutor`` makes it (its worker monitor shuts the executor
        down, and the engine with it, as soon as any worker exits).

        Why here and not in pull mode: a pull D READs from P's surviving rank, whose NIXL
        agent answers without P's engine, in the window before the monitor reaps it. A
        push P's surviving rank WRITEs only as P's engine steps, which a dead rank stops;
        the harness would otherwise keep a wedged P that no vLLM deployment has, whose
        live listener and live agents no D could ever tell from a slow P."""
        pair: Any = self._pair_of(call.engine)
        producer = pair.p
        if producer is not None and producer.process.alive:  # once for several requests
            producer.process.kill(timeout_s=pair.kill_timeout_s)

    def _late_write(self, call: OnPeer) -> None:
        """P stopped with D's registration unread, continued once D gave the load up.

        Why at once, and not after D's handshake as in pull mode (true of every fault on
        P here): a push D sends its registration as soon as its handshake ends, and P
        WRITEs right away, so a fault injected after the handshake races the very write
        it means to stop. A warm D's registration waits, unread, in a stopped P's socket
        buffer."""
        if not call.warm:
            raise RuntimeError(
                f"NixlPushDriver: {call.point.value} needs a warm D (one push from P first): "
                "a cold D's handshake with the stopped P outlasts its deadline, so its "
                "registration is never sent and nothing could be written late"
            )
        self._delay(call.producer, self.LATE_WRITE_CAP_S)
        for rid in call.request_ids:
            self._file_on_peer(call, _LateWrite(call.producer, call.engine), [rid])

    def _kill_at_once(self, call: OnPeer) -> None:
        """A warm D: P stopped now and killed by ``provoke``, so it dies holding the
        registration. A cold D's handshake with a dead P never ends (the load fails;
        nothing was registered)."""
        if call.warm:
            call.producer.process.freeze()
            self._file_on_peer(call, KillOnProvoke(call.producer), call.request_ids)
        else:
            call.producer.process.kill(timeout_s=call.pair.kill_timeout_s)

    def declared(self) -> Declared:
        """Pull's claims about NIXL itself (asynchronous only, the same transport); what
        the push pair builds is its own."""
        return replace(
            super().declared(),
            async_load=Claim(True, "P WRITEs asynchronously; D polls its notifications each step"),
            remote_prefill=Claim(True, "a real P process prefills and WRITEs into D's blocks"),
            tp2=Claim(
                True,
                "P and D each run two TP rank processes in a real gloo world; P rank r "
                "WRITEs into the blocks D rank r registered",
            ),
            hetero_tp=Claim(
                True,
                "P runs its own TP size (p2d1, p1d2); P's push worker maps its head shards "
                "onto D's ranks by the TP ratio, and D waits for every producing rank",
            ),
        )


def _freeze_at_once(call: OnPeer) -> None:
    """SIGSTOP P before D steps: D's registration waits in its socket buffer, P writes
    nothing; only D's deadline ends the load."""
    call.producer.process.freeze()


def make_driver(name: str) -> NixlPushDriver:
    """Entry point ``kvfail.drivers`` ``nixl-push``: kvfail's push connector on D."""
    return NixlPushDriver(name)


def make_upstream_driver(name: str) -> NixlPushDriver:
    """Entry point ``nixl-push:upstream``: upstream's ``NixlPushConnector`` on D, the
    same pair and faults (its findings are upstream's, not a gate)."""
    return NixlPushDriver(name, connector="NixlPushConnector", connector_module=None)
