"""A stand-in P for :class:`kvfail.peers.producer_handle.ProducerHandleBase`'s port handling.

It does what a real P does with its port, and nothing else: bind the port named in
``$KVFAIL_TEST_PORT_ENV`` (no ``SO_REUSEADDR``), die with the bind's ``OSError`` if it is
taken (as Mooncake's bootstrap server and NIXL's side channel do), else print the ready
line and serve ``quit``. No vLLM: this is about the port race, not the transport.
"""

from __future__ import annotations

import json
import os
import socket
import sys

PREFIX = "BINDPEER "


def main() -> None:
    port = int(os.environ[os.environ["KVFAIL_TEST_PORT_ENV"]])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))  # raises "Address already in use" when taken
    sock.listen()
    print(PREFIX + json.dumps({"engine_id": "bind-peer", "port": port}), flush=True)
    for line in sys.stdin:
        if json.loads(line).get("cmd") == "quit":
            break
    sock.close()


if __name__ == "__main__":
    main()
