"""A real NIXL *push* P/D pair: P WRITEs into D's blocks over UCX TCP on 127.0.0.1.

Why its own pair: in push mode the data flows the other way, so the rig must also do
for D what vLLM's engine core does for P: serve D's handshake metadata on D's side
channel (P handshakes with D before it WRITEs). Everything else is :class:`NixlPair`: P
is the same zygote-forked :mod:`kvfail.peers.nixl_producer` process (its connector
``NixlPushConnector``, upstream's, unchanged), D engines are harness engines in this
process, the integrity oracle watches D's blocks, and faults are real signals to P.

Faults that are honest with push on TCP loopback:

* freeze P (SIGSTOP) after both handshakes (a warm pair), before D registers: D's
  ``PUSH_REG`` waits in the kernel's socket buffer, P writes nothing, D's deadline
  fires; thawed, P reads the registration and WRITEs into D's blocks (a late write);
* kill P (SIGKILL) after D registered: P's side channel refuses connections from then
  on, which is how kvfail's D learns P is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfail.peers.nixl import NixlPair, nixl_available
from kvfail.peers.nixl_producer import _handshake_payload
from kvfail.peers.stepping import quarantined

if TYPE_CHECKING:
    from kvfail.harness import Engine

__all__ = ["NixlPushPair", "late_notifications", "nixl_push_available", "quarantined"]

#: kvfail's push connector (D) and upstream's (P, and an upstream D).
KVFAIL_PUSH = ("KvfailNixlPushConnector", "connectors.nixl")
UPSTREAM_PUSH = ("NixlPushConnector", None)


def nixl_push_available() -> str | None:
    """None when a push pair can run here (the same needs as a pull pair)."""
    return nixl_available()


class NixlPushPair(NixlPair):
    """P (subprocess, upstream ``NixlPushConnector``) + D engines here, in push mode, at
    any TP sizes and group count a pull pair takes (P's push worker maps head shards by
    the TP ratio).

    D defaults to kvfail's ``KvfailNixlPushConnector``; pass ``connector=
    "NixlPushConnector"`` (``connector_module=None``) for upstream's D.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("connector", KVFAIL_PUSH[0])
        kwargs.setdefault("connector_module", KVFAIL_PUSH[1])
        kwargs.setdefault("p_connector", UPSTREAM_PUSH[0])
        kwargs.setdefault("p_connector_module", UPSTREAM_PUSH[1])
        super().__init__(**kwargs)

    def _register(self, key: str, engine: Engine) -> Engine:
        """As the pair's, then the new D's side channel is started: what the engine
        core does after KV registration (P handshakes with D to WRITE)."""
        super()._register(key, engine)
        conn = engine.scheduler.connector
        assert conn is not None
        payloads = {(0, w.rank): w.call(_handshake_payload) for w in engine.workers}
        conn.set_xfer_handshake_metadata_pp_aware(payloads)
        return engine


def _worker(engine: Engine) -> Any:
    return engine.workers[0].connector.connector_worker  # type: ignore[attr-defined]


def late_notifications(engine: Engine) -> int:
    """P's completion notifications kvfail's D took for loads it had already failed."""
    return int(getattr(_worker(engine), "kvfail_late_notifications", 0))
