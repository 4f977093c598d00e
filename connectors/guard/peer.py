"""Proof that a load's P is gone, from the address its ``kv_transfer_params`` advertise.

Why: a load the guard failed at its deadline keeps its blocks in quarantine until nothing
can write into them. The inner connector may never say so (its P died mid-pull and it has
no liveness check of its own), so the guard looks for proof itself: P's advertised
endpoint (Mooncake's ``remote_bootstrap_addr``, NIXL's ``remote_host``/``remote_port``)
refusing a TCP connection means no process listens there any more. Anything else (an
accepted connection: a frozen P's kernel still accepts; a timeout; no address in the
params) proves nothing, and the blocks stay held.

The assumption, stated in docs/guard.md: P's transfer dies with the process that served
the advertised endpoint (true of every upstream connector the suite drives, whose P runs
both in one process).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["peer_address", "peer_refuses"]

#: Keys whose value is ``host:port`` or a URL naming P's endpoint.
ADDRESS_KEYS = ("remote_bootstrap_addr",)
#: (host key, port key) pairs naming P's endpoint.
HOST_PORT_KEYS = (("remote_host", "remote_port"),)


def peer_address(params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """P's advertised endpoint in ``params``, or None when they name none."""
    if not isinstance(params, Mapping):
        return None
    for key in ADDRESS_KEYS:
        value = params.get(key)
        if isinstance(value, str) and value:
            parsed = urlsplit(value if "//" in value else f"tcp://{value}")
            try:
                port = parsed.port
            except ValueError:
                continue
            if parsed.hostname and port:
                return parsed.hostname, port
    for host_key, port_key in HOST_PORT_KEYS:
        host, port = params.get(host_key), params.get(port_key)
        if isinstance(host, str) and host and isinstance(port, int) and not isinstance(port, bool):
            return host, port
    return None


def peer_refuses(address: tuple[str, int], timeout_s: float) -> bool:
    """Whether ``address`` actively refuses a TCP connection (nothing listens there)."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED
