"""Separate hosts on one machine: a network namespace per simulated host, joined to the
test's own namespace by a veth pair.

Why namespaces: loopback never drops a packet, never partitions and has no bandwidth
limit, so a connector that is only ever run over 127.0.0.1 has never met the network P/D
runs on. A namespace has its own interfaces, routes and queueing disciplines, so a P
started inside one is reached over a real link that a test can cut silently (a blackhole
route: packets vanish and the caller waits), cut one way only (a routing rule that drops
what reaches the host, while the host's own packets still cross), cut loudly (a prohibit
route: the sender's route lookup fails at once) or throttle (``tc tbf``), and then heal.

Safety: every address used here is assigned by this module to an interface it created,
inside a namespace it created, and is registered with :mod:`kvfail.rig.loopback` for as long
as the namespace lives, so traffic can go only to loopback and to these addresses. Every
namespace and link carries this process's id in its name; :func:`sweep_stale` removes
those of processes that are gone (a run killed before its teardown), and an ``atexit``
hook closes whatever a test forgot.

Nothing here imports vLLM. Creating namespaces needs root and iproute2;
:func:`netns_unavailable` says why a machine cannot, so a gate can fail or skip by policy.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from kvfail.rig.closing import ClosesOnExit
from kvfail.rig.loopback import register_test_address, unregister_test_address

__all__ = [
    "NamespaceHost",
    "PartitionMode",
    "netns_unavailable",
    "sweep_stale",
]

log = logging.getLogger(__name__)

#: Where ``ip netns`` keeps the handles of named namespaces.
NETNS_DIR = Path("/var/run/netns")
#: Every namespace and interface this module makes starts with this, then the owner's pid.
PREFIX = "kvf"
#: The block the /30 of each simulated IPv4 link is drawn from. It exists only on
#: interfaces this module creates; nothing outside the machine is ever addressed.
SUBNET = ipaddress.ip_network("10.213.0.0/16")
#: The same for IPv6 links (a /126 each): a unique-local block (RFC 4193), which no
#: router forwards.
SUBNET6 = ipaddress.ip_network("fd6b:7666:6169:6c00::/64")
#: A simulated link's prefix length, by IP version.
_LINK_PREFIX = {4: 30, 6: 126}

#: ``silent``: packets to the other side vanish (the caller's connect or read times out),
#: as behind a dead switch. ``deaf``: its mirror, one way only: what the test's side sends
#: vanishes on arrival, while what the host sends still crosses. ``refuse``: the route
#: lookup fails at once on both sides (EACCES / "permission denied" or a host-unreachable
#: error), as behind a firewall that rejects.
PartitionMode = Literal["silent", "deaf", "refuse"]
#: The routing-rule preferences a ``deaf`` host uses: its drop rule, then the local table,
#: which the kernel puts first (0) and which must come after the drop to let it act on
#: packets addressed to the host itself.
_DEAF_RULE_PREF = 100
_LOCAL_RULE_PREF = 200

_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[nio]\d+$")
#: Bound on one iproute2 command. Generous: the kernel serialises every link change behind
#: one lock, which a namespace being torn down elsewhere (another test's) can hold for
#: long on a loaded machine, so a command that waits there is slow, not stuck.
_COMMAND_TIMEOUT_S = 60.0
_counter = itertools.count()
#: Whether this process already swept what dead runs left (:func:`sweep_stale`).
_swept = False
_live: dict[str, NamespaceHost] = {}
_live_lock = threading.Lock()


def _ip_binary() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None
    )


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One iproute2 command, bounded in time; its stderr becomes the error's message."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why this machine cannot make simulated hosts, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    ip = _ip_binary()
    if ip is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}n999999"
    made = _run([ip, "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run([ip, "netns", "del", probe], check=False)
    if shutil.which("tc") is None:
        return "iproute2's `tc` is not installed"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else None


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of this module's whose owning process is gone.

    A run killed before its teardown leaves both behind, and a later run must not trip
    over them (a name or an address in use). Returns what was removed."""
    ip = _ip_binary()
    if ip is None:
        return []
    removed: list[str] = []
    links: list[str] = []
    with contextlib.suppress(ValueError):
        listed = json.loads(_run([ip, "-j", "link", "show"], check=False).stdout or "[]")
        links = [str(link.get("ifname", "")) for link in listed]
    namespaces = sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []
    for kind, names in (("link", links), ("netns", namespaces)):
        for name in names:
            owner = _owner(name)
            stale = owner is not None and owner != os.getpid() and not _pid_alive(owner)
            if stale and _run([ip, kind, "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


def _addresses_in_use(version: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    ip = _ip_binary()
    out = _run([ip or "ip", "-j", f"-{version}", "addr", "show"], check=False).stdout or "[]"
    used: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    with contextlib.suppress(ValueError):
        for link in json.loads(out):
            for info in link.get("addr_info", []):
                with contextlib.suppress(ValueError):
                    used.add(ipaddress.ip_address(info.get("local", "")))
    return used


def _pick_subnet(version: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A link-sized subnet of :data:`SUBNET` (IPv4) or :data:`SUBNET6` (IPv6) that no
    interface of the root namespace uses yet.

    Namespaces' own addresses are invisible from here, but each of ours has its peer in
    the root namespace, so a free outer address means a free subnet. The IPv6 block has
    far more subnets than a run makes, so only a window of it is searched."""
    used = _addresses_in_use(version)
    block = SUBNET if version == 4 else SUBNET6
    prefix = _LINK_PREFIX[version]
    count = min(2 ** (prefix - block.prefixlen), 1 << 14)
    start = (os.getpid() * 7 + next(_counter) * 131) % count
    for offset in range(count):
        index = (start + offset) % count
        net = ipaddress.ip_network(
            (int(block.network_address) + (index << (block.max_prefixlen - prefix)), prefix)
        )
        if not any(host in used for host in net.hosts()):
            return net
    raise RuntimeError(f"no free /{prefix} left in {block}")


class NamespaceHost(ClosesOnExit):
    """One simulated host: a namespace with ``lo`` up and a veth link to the test's own
    namespace. The test's side is :attr:`outer_addr`, the host's side :attr:`inner_addr`.
    ``ip_version`` 6 gives the link IPv6 addresses only (unique-local, no duplicate-address
    wait), so whatever crosses it must speak IPv6: the shape of a P/D pair on an IPv6
    network.

    Use as a context manager, or call :meth:`close` in a ``finally``: the namespace, the
    link and any route or queueing discipline on it go away together.
    """

    def __init__(self, ip_version: Literal[4, 6] = 4) -> None:
        ip = _ip_binary()
        if ip is None:
            raise RuntimeError("iproute2's `ip` is not installed")
        self._ip = ip
        global _swept
        if not _swept:  # a run killed before its teardown must not leave names taken
            _swept = True
            sweep_stale()
        index = next(_counter)
        pid = os.getpid()
        self.name = f"{PREFIX}{pid}n{index}"
        self.outer_if = f"{PREFIX}{pid}o{index}"
        self.inner_if = f"{PREFIX}{pid}i{index}"
        if len(self.outer_if) > 15:
            raise RuntimeError(f"interface name {self.outer_if!r} is over 15 characters")
        self.ip_version = ip_version
        self._net = _pick_subnet(ip_version)
        hosts = list(itertools.islice(self._net.hosts(), 2))
        self.outer_addr = str(hosts[0])
        self.inner_addr = str(hosts[1])
        #: ``ip``'s family option and one address's prefix length, for routes.
        self._family = f"-{ip_version}"
        self._host_len = 32 if ip_version == 4 else 128
        self._partition: PartitionMode | None = None
        #: Whether the local table's rule was moved behind :data:`_DEAF_RULE_PREF`.
        self._local_rule_moved = False
        self._limited = False
        self._closed = False
        with _live_lock:
            _live[self.name] = self
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        ip, ns = self._ip, self.name
        _run([ip, "netns", "add", ns])
        _run([ip, "link", "add", self.outer_if, "type", "veth", "peer", "name", self.inner_if])
        _run([ip, "link", "set", self.inner_if, "netns", ns])
        # ``nodad``: an IPv6 address is usable at once, not after duplicate detection.
        nodad = ["nodad"] if self.ip_version == 6 else []
        prefix = self._net.prefixlen
        _run([ip, "addr", "add", f"{self.outer_addr}/{prefix}", "dev", self.outer_if, *nodad])
        inner = [ip, "-n", ns, "addr", "add", f"{self.inner_addr}/{prefix}"]
        _run([*inner, "dev", self.inner_if, *nodad])
        _run([ip, "link", "set", self.outer_if, "up"])
        _run([ip, "-n", ns, "link", "set", self.inner_if, "up"])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        register_test_address(self.outer_addr)
        register_test_address(self.inner_addr)

    # ---------------------------------------------------------------- processes

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec``, which also gives it the
        host's own view of ``/sys/class/net``, where UCX finds its devices)."""
        return [self._ip, "netns", "exec", self.name, *argv]

    # ---------------------------------------------------------------- faults

    def partition(self, mode: PartitionMode = "silent") -> None:
        """Cut the link between the test's namespace and this host, in ``mode``.

        ``silent`` drops, inside the host, every packet bound for the test's side: a SYN
        from outside arrives but its answer vanishes, and the host's own sends vanish too,
        so both sides wait. (A blackhole on the sender's own side would fail at once with
        EINVAL, which is not silent.) ``deaf`` is the mirror: inside the host, a routing
        rule drops every packet that arrives from the test's side, so D's requests,
        acknowledgements and connects vanish, while what the host sends still crosses on a
        connection that is up (P's writes already under way keep landing in D until TCP's
        window, never acknowledged, fills). ``refuse`` makes the route lookup fail on both
        sides, so every send or connect across the link errors at once."""
        self.heal()
        if mode == "silent":
            self._add_route(["-n", self.name], "blackhole", self.outer_addr)
        elif mode == "deaf":
            self._move_local_rule()
            _run(self._deaf_rule("add"))
        elif mode == "refuse":
            self._add_route(["-n", self.name], "prohibit", self.outer_addr)
            self._add_route([], "prohibit", self.inner_addr)
        else:
            raise ValueError(f"unknown partition mode {mode!r}")
        self._partition = mode

    def heal(self) -> None:
        """Undo :meth:`partition`; a link that is not cut is left as it is."""
        mode, self._partition = self._partition, None
        if mode == "silent":
            self._del_route(["-n", self.name], "blackhole", self.outer_addr)
        elif mode == "deaf":
            _run(self._deaf_rule("del"), check=False)
        elif mode == "refuse":
            self._del_route(["-n", self.name], "prohibit", self.outer_addr)
            self._del_route([], "prohibit", self.inner_addr)

    def _deaf_rule(self, verb: str) -> list[str]:
        """``ip rule`` ``verb`` for the host's drop of what arrives from the test's side."""
        where = ["iif", self.inner_if, "from", f"{self.outer_addr}/{self._host_len}"]
        rule = ["rule", verb, "pref", str(_DEAF_RULE_PREF), *where, "blackhole"]
        return [self._ip, self._family, "-n", self.name, *rule]

    def _move_local_rule(self) -> None:
        """Put the host's local-table rule behind the drop rule (once; the rule lives and
        goes with the host's namespace). Only the order changes: every other packet still
        meets the local table before any other."""
        if self._local_rule_moved:
            return
        rule = [self._ip, self._family, "-n", self.name, "rule"]
        _run([*rule, "add", "pref", str(_LOCAL_RULE_PREF), "lookup", "local"])
        _run([*rule, "del", "pref", "0"])
        self._local_rule_moved = True

    def _add_route(self, where: list[str], kind: str, addr: str) -> None:
        _run([self._ip, self._family, *where, "route", "add", kind, f"{addr}/{self._host_len}"])

    def _del_route(self, where: list[str], kind: str, addr: str) -> None:
        route = [self._ip, self._family, *where, "route", "del", kind, f"{addr}/{self._host_len}"]
        _run(route, check=False)

    @property
    def partitioned(self) -> PartitionMode | None:
        return self._partition

    def limit(self, rate: str, *, burst: str = "32kbit", latency: str = "50ms") -> None:
        """Throttle both directions of the link to ``rate`` (``tc tbf``: ``"10mbit"``)."""
        self.unlimit()
        spec = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _run(["tc", "qdisc", "add", "dev", self.outer_if, *spec])
        _run(["tc", "-n", self.name, "qdisc", "add", "dev", self.inner_if, *spec])
        self._limited = True

    def unlimit(self) -> None:
        if not self._limited:
            return
        self._limited = False
        _run(["tc", "qdisc", "del", "dev", self.outer_if, "root"], check=False)
        _run(["tc", "-n", self.name, "qdisc", "del", "dev", self.inner_if, "root"], check=False)

    def qdiscs(self) -> list[str]:
        """The queueing disciplines on both ends, as ``tc`` names them (for evidence)."""
        found: list[str] = []
        for argv in (
            ["tc", "-j", "qdisc", "show", "dev", self.outer_if],
            ["tc", "-j", "-n", self.name, "qdisc", "show", "dev", self.inner_if],
        ):
            with contextlib.suppress(ValueError):
                found += [str(q.get("kind")) for q in json.loads(_run(argv).stdout or "[]")]
        return found

    # ---------------------------------------------------------------- lifetime

    def exists(self) -> bool:
        return (NETNS_DIR / self.name).exists()

    def close(self) -> None:
        """Remove the link (both ends go together) and the namespace. Idempotent, and
        never raises: it runs from teardowns and ``atexit``."""
        if self._closed:
            return
        self._closed = True
        unregister_test_address(self.outer_addr)
        unregister_test_address(self.inner_addr)
        self._del_route([], "prohibit", self.inner_addr)
        for argv in (
            [self._ip, "link", "del", self.outer_if],
            [self._ip, "netns", "del", self.name],
        ):
            try:
                _run(argv, check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("netns clean-up %s failed: %s", " ".join(argv), exc)
        with _live_lock:
            _live.pop(self.name, None)

    def __repr__(self) -> str:
        return f"NamespaceHost({self.name}, {self.outer_addr} <-> {self.inner_addr})"


@atexit.register
def _close_forgotten() -> None:
    with _live_lock:
        hosts = list(_live.values())
    for host in hosts:
        host.close()
