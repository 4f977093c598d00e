"""Where in a KV load a failure was detected.

The stage is the first thing an operator needs when a request fails: it says whether to
look at the bootstrap service, the peer process, the network or the connector itself. A
small closed set keeps the per-stage counters (and Prometheus label values) bounded.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """Failure stages, in the order a load passes through them."""

    #: kv_transfer_params unusable: missing keys, bad address, wrong types.
    PARAMS = "params"
    #: Peer discovery: bootstrap server down, unknown engine id.
    BOOTSTRAP = "bootstrap"
    #: Side-channel or agent-metadata exchange with the peer.
    HANDSHAKE = "handshake"
    #: Building the transfer (descriptor lists, handle creation, posting).
    TRANSFER_SETUP = "transfer_setup"
    #: The data movement itself failed (transport error, reset, partial write).
    TRANSFER = "transfer"
    #: The peer answered, and its answer is a failure (ERROR, err_reqs, no result).
    PEER = "peer"
    #: A liveness signal says the peer is gone (probe failed, socket monitor).
    PEER_LOST = "peer_lost"
    #: Completion notification to or from the peer failed.
    NOTIFICATION = "notification"
    #: The load outlived its deadline: a silent peer or a stuck transfer.
    WATCHDOG = "watchdog"
    #: The connector's own code raised while handling the load.
    INTERNAL = "internal"


ACTIVE_STAGES: frozenset[Stage] = frozenset(Stage) - {Stage.WATCHDOG}
"""Stages reported by an error surfacing, as opposed to a deadline expiring."""
