"""Notification faults: D's done-notifications to P that are dropped or fail to send, at
the transport boundary (D's NIXL agent handle), in-process or on each D rank process.

Apart from :mod:`kvfail.peers.nixl` because wrapping D's agent to break one message is a
fault of its own; the pair only arms it
(:meth:`~kvfail.peers.nixl.NixlPair.break_notifications`) and reads what fired.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfail.harness import Engine
    from kvfail.harness.hooks import RankView

__all__ = ["NotificationFaults", "NotifyFaultAgent", "RankNotificationFaults"]


class NotificationFaults:
    """D's done-notifications to P that must never arrive, by P's request id.

    Why at the transport boundary: upstream D tells P it is done in two ways, and a fault
    must hit both the way the transport would. An ordinary READ carries the notification
    itself (``make_prepped_xfer(..., notif_msg=...)``, sent by NIXL when the READ
    completes): here that READ is posted for real, without its notification (lost in
    flight). A pull with nothing to read (an aborted request, a full local hit) and the
    deferred notifications of split reads call ``send_notif``: here that raises
    ``nixlBackendError`` (a failed send; upstream logs ``notification_failed``). Only
    messages of the done-notification form ``<P request id>:<consumers>`` naming an armed
    id are touched; heartbeats and every other call go to the real agent.
    """

    def __init__(self) -> None:
        self.armed: set[str] = set()
        #: P request ids whose notification was dropped from a READ / whose send raised.
        self.dropped: list[str] = []
        self.raised: list[str] = []
        self._lock = threading.Lock()

    def arm(self, remote_request_id: str) -> None:
        with self._lock:
            self.armed.add(remote_request_id)

    def fired(self, remote_request_id: str) -> bool:
        with self._lock:
            return remote_request_id in self.dropped or remote_request_id in self.raised

    def hit(self, notif_msg: Any, kind: str) -> bool:
        """Whether ``notif_msg`` is an armed done-notification (recorded under ``kind``)."""
        try:
            raw = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
            text = raw.decode()
        except (TypeError, ValueError):
            return False
        req_id, sep, consumers = text.rpartition(":")
        with self._lock:
            if not (sep and consumers.isdigit() and req_id in self.armed):
                return False
            (self.dropped if kind == "dropped" else self.raised).append(req_id)
            return True


class NotifyFaultAgent:
    """A D worker's ``nixl_wrapper`` with :class:`NotificationFaults` applied."""

    def __init__(self, agent: Any, faults: NotificationFaults) -> None:
        self._agent = agent
        self.kvfail_notify_faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        faults = self.kvfail_notify_faults
        if "notif_msg" in kwargs:
            if faults.hit(kwargs["notif_msg"], "dropped"):
                kwargs["notif_msg"] = b""
        elif len(args) > 5 and faults.hit(args[5], "dropped"):
            args = (*args[:5], b"", *args[6:])
        return self._agent.make_prepped_xfer(*args, **kwargs)

    def send_notif(self, remote_agent_name: str, notif_msg: Any, *args: Any, **kwargs: Any) -> Any:
        if self.kvfail_notify_faults.hit(notif_msg, "raised"):
            raise _nixl_error(f"kvfail: notification {notif_msg!r} to {remote_agent_name} failed")
        return self._agent.send_notif(remote_agent_name, notif_msg, *args, **kwargs)


# Module-level: ``Worker.call`` pickles them by reference into a D rank process.


def _faults_on_rank(view: RankView) -> NotificationFaults:
    """This rank's :class:`NotificationFaults`, installed on its NIXL agent on first use."""
    nixl_worker: Any = view.connector.connector_worker  # type: ignore[attr-defined]
    if not isinstance(nixl_worker.nixl_wrapper, NotifyFaultAgent):
        nixl_worker.nixl_wrapper = NotifyFaultAgent(nixl_worker.nixl_wrapper, NotificationFaults())
    faults: NotificationFaults = nixl_worker.nixl_wrapper.kvfail_notify_faults
    return faults


def _arm_notify(view: RankView, remote_request_id: str) -> None:
    _faults_on_rank(view).arm(remote_request_id)


def _notify_fired(view: RankView) -> tuple[list[str], list[str]]:
    faults = _faults_on_rank(view)
    with faults._lock:
        return list(faults.dropped), list(faults.raised)


class RankNotificationFaults:
    """:class:`NotificationFaults` for a D whose TP ranks are processes: one per rank,
    installed and armed there (every rank: each tells its own P rank). What fired is
    read back from the ranks (:meth:`refresh`, called by
    :meth:`~kvfail.peers.nixl.NixlPair.observe` after each step) and kept, so it can still
    be asked after D's ranks are gone."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.armed: set[str] = set()
        self.dropped: list[str] = []
        self.raised: list[str] = []

    def arm(self, remote_request_id: str) -> None:
        for worker in self._engine.workers:
            worker.call(_arm_notify, remote_request_id)
        self.armed.add(remote_request_id)

    def refresh(self) -> None:
        """Read what fired from every rank still there (a gone rank keeps its last)."""
        dropped, raised = set(self.dropped), set(self.raised)
        for worker in self._engine.workers:
            if worker.process is None or not worker.process.alive():
                continue
            try:
                d, r = worker.call(_notify_fired)
            except Exception:
                continue
            dropped.update(d)
            raised.update(r)
        self.dropped, self.raised = sorted(dropped), sorted(raised)

    def fired(self, remote_request_id: str) -> bool:
        self.refresh()
        return remote_request_id in self.dropped or remote_request_id in self.raised


def _nixl_error(message: str) -> Exception:
    """NIXL's own backend error when the bindings are importable, else RuntimeError."""
    try:
        from nixl._api import nixlBind

        return nixlBind.nixlBackendError(message)  # type: ignore[no-any-return]
    except Exception:
        return RuntimeError(message)
