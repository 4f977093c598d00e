"""Loopback-only address checks shared by the proxy and the process helpers.

Fault injection must never touch a real network: a proxy bound to 0.0.0.0 or forwarding to
a routable host would let a test hurt (or be hurt by) something outside the machine. Every
address that enters this package goes through `require_loopback` first.
"""

from __future__ import annotations

import ipaddress

LOOPBACK = "127.0.0.1"


def require_loopback(host: str) -> str:
    """Return `host` if it is a literal IPv4 loopback address, else raise ValueError.

    Literal addresses only: resolving a name could yield a non-loopback address (or block on
    DNS), both of which this package promises never to do.
    """
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"not a literal IP address: {host!r} (loopback only)") from None
    if addr.version != 4 or not addr.is_loopback:
        raise ValueError(f"refusing {host!r}: only IPv4 loopback (127.0.0.0/8) is allowed")
    return host
