"""kvfail's NIXL D tells a refused side channel from a silent one before its handshake.

Why: zmq retries a refused connect silently, so upstream's D learns that nothing listens
at P's side channel only from its receive timeout; kvfail's D fails those loads at
``handshake`` at once. A path that accepts or drops packets must not look refused: that
is the deadline's case. Real sockets on 127.0.0.1; the whole handshake path runs in
``bench.nixl_detection`` (fault ``refuse``) and the suite's ``refuse`` scenarios.
"""

from __future__ import annotations

import socket

from tests.transports import require_transport

require_transport("nixl")


def test_a_refused_side_channel_is_told_from_a_listening_one() -> None:
    from connectors.nixl.connector import _refuses
    from kvfail.peers.base import closed_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert not _refuses("127.0.0.1", port, 0.5)
    assert _refuses("127.0.0.1", closed_port(), 0.5)
