"""Address checks shared by the proxy, the process helpers and the simulated hosts.

Fault injection must never touch a real network: a proxy bound to 0.0.0.0 or forwarding to
a routable host would let a test hurt (or be hurt by) something outside the machine. Every
address the rig binds or connects to goes through `require_local` first, which admits loopback
and nothing else but the addresses of simulated hosts that this process created itself
(:mod:`kvfail.faults.netns` registers them while the namespace lives).
"""

from __future__ import annotations

import ipaddress
import socket
import threading

LOOPBACK = "127.0.0.1"
LOOPBACK6 = "::1"

_test_addresses: set[str] = set()
_lock = threading.Lock()


def family(host: str) -> socket.AddressFamily:
    """The socket family of a literal address."""
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def register_test_address(host: str) -> None:
    """Admit ``host``, an address on an interface this process made, until unregistered."""
    with _lock:
        _test_addresses.add(str(ipaddress.ip_address(host)))


def unregister_test_address(host: str) -> None:
    with _lock:
        _test_addresses.discard(str(ipaddress.ip_address(host)))


def require_local(host: str) -> str:
    """Return `host` if it is a literal loopback address (IPv4 or IPv6) or the address of a
    live simulated host of this process's, else raise ValueError.

    Literal addresses only: resolving a name could yield a routable address (or block on
    DNS), both of which this package promises never to do.
    """
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"not a literal IP address: {host!r} (loopback only)") from None
    if addr.is_loopback:
        return host
    with _lock:
        if str(addr) in _test_addresses:
            return host
    raise ValueError(
        f"refusing {host!r}: only loopback and the addresses of this run's own simulated "
        "hosts are allowed"
    )
