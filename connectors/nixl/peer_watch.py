"""A load whose P is gone fails at once, in pull and push mode alike.

Why one watch for both: without it a D learns of a dead P only from its own transfer
(a READ's UCX endpoint failing, many seconds later) or from its deadline, and a push D
posts no transfer at all, so a P that dies after D's registration went out is noticed
only at the deadline. Each step, before upstream polls, every load still waiting is
matched with its P's side channel (:class:`~connectors.nixl.probe.SideChannelProbes`,
non-blocking): a refusal, or a host name that stops resolving, fails the load at
``peer_lost`` and reports it at once.

Failing is not freeing. The worker's own fence (``kvfail_fence``) decides when the
blocks go back: a pull D once its READs have ended, a push D once P's writers are proven
gone or have notified. Until then the load is held, and its fence is retried here at
every step.
"""

from __future__ import annotations

import time
from typing import Any

from connectors.nixl.probe import SideChannelProbes
from kvfail.stages import Stage

__all__ = ["PeerWatch"]


class PeerWatch:
    """The NIXL workers' watch on the P each waiting load came from (module docstring).

    Put it first among a worker's kvfail bases; it needs the reporter mixin's calls and
    upstream's ``_recving_metadata``."""

    _recving_metadata: dict[str, Any]

    def _kvfail_init_peer_watch(self, interval_s: float | None) -> None:
        """Probe each P no more often than ``interval_s``; None: no watch (a dead P is then
        left to the transport and the deadline)."""
        self._kvfail_probes = None if interval_s is None else SideChannelProbes(interval_s)
        #: P engine id -> the side channel its handshake used (written by the handshake
        #: thread, read at drains).
        self._kvfail_side_channels: dict[str, tuple[str, int]] = {}
        #: Load -> when D first watched its P: an older refusal may be an earlier P's.
        self._kvfail_watched: dict[str, float] = {}
        #: Loads failed because their P is gone, whose transfer may not have ended yet.
        self._kvfail_unfenced: set[str] = set()

    def _kvfail_before_poll(self) -> None:
        self._kvfail_watch_peers()

    def shutdown(self) -> None:
        if self._kvfail_probes is not None:
            self._kvfail_probes.close()
        super().shutdown()  # type: ignore[misc]

    def _kvfail_watch_peers(self) -> None:
        """Fail every waiting load whose P is gone; retry the fence of those failed
        earlier until their transfer can no longer write."""
        this: Any = self
        tracker = this.failure_reporter
        for req_id in list(self._kvfail_unfenced):
            if not (tracker.is_quarantined(req_id) or tracker.is_tracked(req_id)):
                self._kvfail_unfenced.discard(req_id)  # released by the deadline's fence
            elif this.kvfail_fence(req_id):
                self._kvfail_unfenced.discard(req_id)
                this.load_fenced(req_id)
        probes = self._kvfail_probes
        if probes is None:
            return
        now = time.monotonic()
        watched: dict[str, float] = {}
        # A copy: a fence that holds forgets the load's metadata.
        for req_id, meta in list(self._recving_metadata.items()):
            remote = meta.remote
            if remote is None or not tracker.is_tracked(req_id):
                continue
            if tracker.failure_of(req_id) is not None:
                continue
            addr = self._kvfail_side_channels.get(remote.engine_id)
            if addr is None and remote.host and remote.port:
                addr = (remote.host, int(remote.port))
            if addr is None:
                continue
            since = watched[req_id] = self._kvfail_watched.get(req_id, now)
            if probes.gone(addr, since=since, waiter=req_id):
                self._kvfail_p_gone(
                    req_id, f"P's side channel {addr[0]}:{addr[1]} refuses connections: P is gone"
                )
            elif (unresolved := probes.unresolved(addr, since=since)) is not None:
                # Not proof that P is gone, but nothing can reach it any more: the load
                # fails, and its blocks wait for the fence, as for a gone P.
                self._kvfail_p_gone(req_id, f"P's side channel host {unresolved}")
        for req_id in self._kvfail_watched.keys() - watched.keys():
            probes.forget(req_id)
        self._kvfail_watched = watched

    def _kvfail_p_gone(self, req_id: str, reason: str) -> None:
        """Report the load failed now; its blocks go back once its fence holds."""
        this: Any = self
        if not this.failure_reporter.quarantine:
            # Only recorded: delivered when the transfer ends, or by the deadline's fence.
            this.load_failed(req_id, Stage.PEER_LOST, reason, settle=False)
            return
        this.load_failed(req_id, Stage.PEER_LOST, reason, fenced=False)
        if this.kvfail_fence(req_id):
            this.load_fenced(req_id)
        else:
            self._kvfail_unfenced.add(req_id)
