"""kvfail's connectors between separate hosts: P on a simulated host of its own (a network
namespace), D in the test's namespace, a real transport over the link: Mooncake TCP, and
NIXL's UCX TCP, pull (D READs from P) and push (P WRITEs into D's blocks, so P also
reaches D's side channel across the link).

Why: on loopback a peer can die or stop, but the network never drops a packet, refuses
a route or runs out of bandwidth. Here the link is cut while many loads are in flight:
silently (packets vanish, as behind a dead switch), one way only (D's packets vanish
while P's still cross) and loudly (the route is refused), then healed. What must hold is
what holds on loopback: every load is reported exactly once, a load that P may still
serve keeps its blocks until nothing can write into them, no byte lands in a block the
scheduler got back, and D serves again after the heal.

No assertion reads a time; each wait is bounded and names what it waited for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Literal

import pytest

from tests.child_pytest import ROOT, run_child_pytest
from tests.transports import require_netns, require_transport
from tests.waiting import step_until

require_transport("mooncake")
require_transport("nixl")
require_netns()

from kvfail.faults.netns import NamespaceHost, PartitionMode  # noqa: E402
from kvfail.harness import Engine, RunResult, oracles  # noqa: E402
from kvfail.peers.base import PeerPair  # noqa: E402
from kvfail.peers.mooncake import MooncakePair  # noqa: E402
from kvfail.peers.nixl import NixlPair  # noqa: E402
from kvfail.peers.nixl_exit_guard import install_exit_guard  # noqa: E402
from kvfail.peers.nixl_push import NixlPushPair  # noqa: E402
from kvfail.peers.stepping import all_blocks_free, quarantined  # noqa: E402
from kvfail.rig.processes import PeerExitedError  # noqa: E402

#: One xdist worker for the whole module and ``tests/faults/test_netns.py``: split test by
#: test, each worker built its own namespaced pair (the module's fixture) while the other
#: ran the IPv6 child's, and the namespace and route changes of both contended for the
#: kernel's network configuration lock (a fresh-clone run saw ``ip route del`` pass its
#: 20 s bound, another a cold NIXL load pass D's deadline).
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("simulated-hosts")]

DEADLINE_S = 3.0
#: Bound on every wait below (a failure names what was still missing).
WAIT_S = 60.0
MANY = 4
KVFAIL = "kvfail"


#: Set, to the transport it runs, in the fresh process that runs NIXL over an IPv6-only
#: link (:func:`test_nixl_over_an_ipv6_only_link_in_a_fresh_process`).
IPV6_CHILD_ENV = "KVFAIL_TEST_HOSTS_IPV6"
#: The NIXL transports that run over an IPv6-only link, each in a process of its own.
IPV6_TRANSPORTS = ("nixl", "nixl-push")
#: The transports whose pairs run over the link: each on IPv4 here, and NIXL (pull and
#: push) on an IPv6-only link (the shape of a P/D pair on an IPv6 network) in a process of
#: its own. Mooncake has no IPv6 case: upstream's Mooncake P cannot serve on an IPv6
#: address (:func:`test_upstream_mooncake_p_cannot_serve_on_ipv6` pins the evidence).
_IPV6_CHILD = os.environ.get(IPV6_CHILD_ENV)
IP_VERSION: Literal[4, 6] = 6 if _IPV6_CHILD in IPV6_TRANSPORTS else 4
TRANSPORTS = [_IPV6_CHILD] if IP_VERSION == 6 else ["mooncake", "nixl", "nixl-push"]


def _new_pair(transport: str, host: NamespaceHost) -> PeerPair:
    """kvfail's D connector of ``transport``; P runs upstream's (a D-side test)."""
    extra = {"kvfail_deadline_s": DEADLINE_S}
    if transport == "mooncake":
        return MooncakePair(
            policy="fail",
            connector="KvfailMooncakeConnector",
            connector_module="connectors.mooncake",
            p_connector="MooncakeConnector",
            host=host,
            extra_config=extra,
            # P must not expire a prefilled request while the link is cut: its writes
            # after the heal are what these tests judge, and on a busy machine the cut
            # can outlast the short expiry the pair gives P by default.
            p_abort_request_timeout_s=int(WAIT_S),
        )
    if transport == "nixl-push":
        return NixlPushPair(host=host, extra_config=extra, build_default_consumer=False)
    return NixlPair(
        connector="KvfailNixlConnector",
        connector_module="connectors.nixl",
        host=host,
        extra_config=extra,
        build_default_consumer=False,
    )


@pytest.fixture(scope="module")
def link() -> Iterator[NamespaceHost]:
    """One simulated host for every pair of the module. Why shared: UCX caches the routes
    it saw, so in a process whose NIXL agents used one link, an agent built on a link made
    after that one was removed cannot reach even itself ("no route", and no backend)."""
    with NamespaceHost(ip_version=IP_VERSION) as host:
        yield host


@pytest.fixture(scope="module", params=TRANSPORTS, ids=[f"{t}-ipv{IP_VERSION}" for t in TRANSPORTS])
def pair(request: pytest.FixtureRequest, link: NamespaceHost) -> Iterator[PeerPair]:
    transport = request.param
    if transport.startswith("nixl"):
        install_exit_guard(request.config)
    p = _new_pair(transport, link)
    try:
        p.consumer("fail", name=KVFAIL)
        _warm(p)
        yield p
    finally:
        p.close()


@pytest.fixture
def host(pair: PeerPair) -> NamespaceHost:
    """The simulated host the pair's P runs on."""
    assert pair.host is not None
    return pair.host


@pytest.fixture(autouse=True)
def healed(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails half-way must not leave the next one partitioned."""
    host = request.getfixturevalue("host") if "pair" in request.fixturenames else None
    yield
    if host is not None:
        host.heal()
        host.unlimit()


def _engine(pair: PeerPair, policy: str = "fail") -> Engine:
    """kvfail's D under ``policy``: the pair's warm one for ``fail``, another built on first
    use for ``recompute`` (it warms up in the test that wants it)."""
    if policy == "fail":
        return pair.decoders[KVFAIL]
    return pair.consumer(policy, name=f"{KVFAIL}-{policy}")


def _warm(pair: PeerPair, engine: str | Engine = KVFAIL) -> None:
    """Load once over the new link with ``engine`` (default: the ``fail`` D). The first
    load pays the handshake (NIXL's metadata exchange and UCX endpoints over the veth
    link), and on a loaded machine that can pass D's deadline: D then fails it at the
    watchdog, which is the connector doing its job, not the link failing, and no test
    here is about a cold handshake's latency. So the pair's warm-up tries again, within
    ``WAIT_S``, once the failed load's blocks are back."""
    pair.warm(engine, within_s=WAIT_S, timeout_s=WAIT_S)


def _load(pair: PeerPair, rid: str, engine: Engine) -> RunResult:
    """P prefills ``rid`` and D loads it to its report, within ``WAIT_S``."""
    pair.prefill_and_add(rid, prompt_len=80, consumer=engine)
    run = pair.run([rid], consumer=engine, timeout_s=WAIT_S)
    assert run.ok, (run, pair.records[rid])
    return run


def _load_ok(pair: PeerPair, rid: str, engine: Engine | None = None) -> None:
    engine = engine or _engine(pair)
    run = _load(pair, rid, engine)
    assert pair.verify(rid), (run, pair.records[rid])
    assert oracles.check_all(engine, [rid], failed=False) == []


def test_loads_cross_the_link_with_exact_bytes(pair: PeerPair, host: NamespaceHost) -> None:
    assert pair.p is not None and pair.p.address == host.inner_addr
    _load_ok(pair, "hosts-happy")


#: How often the control's wait asks the integrity oracle (a look at every rank's
#: blocks) while D steps.
_ASK_ORACLE_EVERY_S = 0.1


def _fail_across_cut(
    pair: PeerPair, host: NamespaceHost, engine: Engine, rids: list[str], mode: PartitionMode
) -> None:
    """P prefills each of ``rids`` (P then holds its KV), the link is cut in ``mode``, and
    D loads them: each must be reported, within ``WAIT_S``, as failed."""
    params = {rid: pair.prefill(rid, 80) for rid in rids}
    host.partition(mode)
    records = [pair.add(rid, params[rid], prompt_len=80, consumer=engine) for rid in rids]
    step_until(
        pair,
        engine,
        lambda: all(r.reported_s is not None for r in records),
        "every load's report",
        WAIT_S,
    )
    assert all(r.failed for r in records), records


def _cut_during_loads(
    pair: PeerPair,
    host: NamespaceHost,
    engine: Engine,
    stem: str,
    mode: PartitionMode = "silent",
) -> list[str]:
    """``MANY`` loads from a warm D (its connection to P is up) cut without a refusal.
    ``silent``: D's pull requests still reach P, whose writes back vanish until the heal.
    ``deaf``, its mirror: D's requests vanish on the way (TCP sends them again after the
    heal, and P serves them then), while P's packets would still cross. Either way D
    hears nothing, and P may write once the link is back. Returns the ids, each already
    reported."""
    # A precondition, not a verdict: on a loaded machine pulls over the link can miss the
    # short deadline, so the warm-up retries within WAIT_S (three tries were once not
    # enough, with three workers on two cores).
    _warm(pair, engine)
    rids = [f"{stem}-{i}" for i in range(MANY)]
    _fail_across_cut(pair, host, engine, rids, mode)
    if engine.spec.policy == "fail":  # under recompute each runs on, in fresh blocks
        assert all(engine.status(rid).name == "FINISHED_ERROR" for rid in rids)
    return rids


#: The cuts without a refusal, by policy: the silent cut under both; its mirror under
#: ``fail`` only (what it adds is which way the link fails, which the policy does not touch).
_QUIET_CUTS = [("silent", "fail"), ("silent", "recompute"), ("deaf", "fail")]


@pytest.mark.parametrize(("mode", "policy"), _QUIET_CUTS, ids=[f"{m}-{p}" for m, p in _QUIET_CUTS])
def test_a_silent_partition_during_many_loads_fails_each_once_and_holds_until_healed(
    pair: PeerPair, host: NamespaceHost, mode: PartitionMode, policy: str
) -> None:
    """Under both policies: ``recompute`` serves each request again in fresh blocks while
    the failed load's blocks stay held, and the policy oracle checks it completed. The
    ``deaf`` cut is the mirror: D's pulls, not P's answers, are what vanish."""
    engine = _engine(pair, policy)
    rids = _cut_during_loads(pair, host, engine, f"hosts-{mode}-{policy}", mode)
    # P got every pull before its answers were cut (silent), or gets them after the heal
    # (deaf): either way each may still be written, so held however long the link is down.
    held = quarantined(engine)
    assert held["loads"] == MANY and held["blocks"] > 0, held
    for _ in range(50):
        engine.step()
        pair.observe(engine)
    assert quarantined(engine) == held
    assert not all_blocks_free(engine)
    host.heal()
    # The late writes really happened, after the heal.
    assert pair.wait_finished_sending(engine, rids, WAIT_S), "P's writes of the cut loads"
    step_until(
        pair, engine, lambda: quarantined(engine)["loads"] == 0, "the holds' release", WAIT_S
    )
    step_until(pair, engine, lambda: all_blocks_free(engine), "every block back", WAIT_S)
    # None of P's late writes landed in a block the scheduler had back.
    assert pair.integrity_findings(engine) == []
    assert oracles.check_all(engine, rids, failed=True) == []
    _load_ok(pair, f"hosts-after-{mode}-{policy}", engine)


@pytest.mark.parametrize("mode", ["silent", "deaf"])
def test_control_freeing_at_the_deadline_is_flagged_across_the_partition(
    pair: PeerPair, host: NamespaceHost, mode: PartitionMode
) -> None:
    """Negative control: the same cut, on a D whose fence says "over" at once (fail fast,
    free at once). P's writes after the heal then land in blocks the scheduler freed, and
    the integrity oracle must name them: the test above can fail, for either cut."""
    control = pair.consumer("fail", name=f"hosts-control-{mode}")
    worker = control.workers[0].connector.connector_worker
    worker.failure_reporter._fence = lambda req_id: True  # no hold: blocks back at once
    try:
        _cut_during_loads(pair, host, control, f"hosts-control-{mode}", mode)
        assert quarantined(control)["loads"] == 0
        host.heal()
        # Stepped until P's late write is seen in a freed block (a READ the control let
        # go never tells P it ended: P's lease, not a notification, would end its wait).
        done = pair.step_until(
            control,
            lambda: any("write after release" in f for f in pair.integrity_findings(control)),
            WAIT_S,
            ask_every_s=_ASK_ORACLE_EVERY_S,
        )
        findings = pair.integrity_findings(control)
        assert done and any("write after release" in f for f in findings), findings
    finally:
        control.close()
        pair.decoders.pop(f"hosts-control-{mode}", None)


def test_a_refused_route_fails_loads_at_once_and_strands_nothing(
    pair: PeerPair, host: NamespaceHost
) -> None:
    engine = _engine(pair)
    rids = [f"hosts-refused-{i}" for i in range(MANY)]
    _fail_across_cut(pair, host, engine, rids, "refuse")
    host.heal()
    step_until(
        pair, engine, lambda: quarantined(engine)["loads"] == 0, "the holds' release", WAIT_S
    )
    step_until(
        pair, engine, lambda: all_blocks_free(engine), "every block back in the pool", WAIT_S
    )
    assert pair.integrity_findings(engine) == []
    assert oracles.check_all(engine, rids, failed=True) == []
    _load_ok(pair, "hosts-after-refused")


def test_a_bandwidth_limited_link_still_delivers_exact_bytes(
    pair: PeerPair, host: NamespaceHost
) -> None:
    host.limit("20mbit")
    assert host.qdiscs() == ["tbf", "tbf"]
    for i in range(2):
        _load_ok(pair, f"hosts-slow-link-{i}")


def test_upstream_mooncake_p_cannot_serve_on_ipv6() -> None:
    """Why :data:`TRANSPORTS` has no Mooncake IPv6 case, as evidence rather than a note:
    upstream's Mooncake P binds its side channel at ``tcp://{host}:*``, with neither
    brackets nor ZMQ's IPv6 option, so on an IPv6 address P stops at start. When this
    fails, upstream's P serves on IPv6 and Mooncake belongs among the IPv6 transports."""
    with NamespaceHost(ip_version=6) as host:
        pair: PeerPair | None = None
        with pytest.raises(PeerExitedError) as stopped:
            pair = _new_pair("mooncake", host)
            pair.consumer("fail", name=KVFAIL)
        if pair is not None:
            pair.close()
    assert "ZMQError: No such device" in str(stopped.value), stopped.value
    assert host.inner_addr in str(stopped.value)


@pytest.mark.parametrize("transport", IPV6_TRANSPORTS)
def test_nixl_over_an_ipv6_only_link_in_a_fresh_process(transport: str) -> None:
    """NIXL, pull and push, between hosts that share only an IPv6 link: exact bytes, a silent
    cut during many loads held until the heal, a refused route and a throttled link, as
    above.

    Why a fresh process each: UCX reads the routing table once per process and keeps it,
    and its TCP transport cannot tell an IPv6 peer in its own subnet without it, so a link
    made after a process's first NIXL agent is "no route" to its agent, or no backend at
    all (a D in production meets the same when an interface appears after it started).
    The deadline-free control and the one-way (``deaf``) cut stay with the IPv4 links:
    what they show does not depend on the address family."""
    if _IPV6_CHILD is not None:
        return  # the child itself: its cases are the pair's ``-ipv6`` ones
    rc, out = run_child_pytest(
        [
            __file__,
            *("-o", "addopts=", "-p", "no:randomly"),
            *("-k", f"{transport}-ipv6 and not control and not deaf"),
        ],
        cwd=ROOT,
        timeout_s=600,
        env={IPV6_CHILD_ENV: transport},
    )
    assert rc == 0 and re.search(r"\b5 passed", out), out[-6000:]
