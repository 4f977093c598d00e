"""kvfail's D connectors when P is named by a hostname, and the name stops resolving.

Why: operators point D at P by name (a service name, a pod's DNS entry). A name that
stops resolving (the entry removed, the resolver gone) must be a reported failure of the
loads that need it, never a crash of D's engine step, a load left waiting, or proof that
P's writes are over. D reaches P by name where ``kv_transfer_params`` names it: NIXL's
``remote_host`` (D's handshake, pull and push, and kvfail's probe), Mooncake's
``remote_bootstrap_addr`` (D's bootstrap lookup).

The resolver is the run's own: the checks run in a child process with a private mount
namespace (``unshare -m``) in which ``/etc/hosts`` is a file this test writes, and
``/etc/nsswitch.conf`` says ``hosts: files``, so a name that is gone is never asked of a
DNS server outside the machine. P serves on loopback. No assertion reads a time.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.child_pytest import ROOT, run_child_pytest
from tests.transports import require_transport
from tests.waiting import step_until

require_transport("mooncake")
require_transport("nixl")

from kvfail.harness import Engine, oracles  # noqa: E402
from kvfail.peers.base import PeerPair, with_param  # noqa: E402
from kvfail.peers.mooncake import MooncakePair  # noqa: E402
from kvfail.peers.nixl import NixlPair  # noqa: E402
from kvfail.peers.nixl_exit_guard import install_exit_guard  # noqa: E402
from kvfail.peers.nixl_push import NixlPushPair  # noqa: E402
from kvfail.peers.stepping import all_blocks_free  # noqa: E402

pytestmark = pytest.mark.vllm

#: Set in the child to the file bind-mounted on ``/etc/hosts`` there.
HOSTS_FILE_ENV = "KVFAIL_TEST_HOSTS_FILE"
_HOSTS_FILE = os.environ.get(HOSTS_FILE_ENV)
#: P's name, resolved by the child's own ``/etc/hosts`` only.
NAME = "kvfail-p.test"
#: D's load deadline. A load whose name does not resolve fails on the failed lookup, not
#: on this; a good load must never meet it, even a cold D's first one on a busy machine.
DEADLINE_S = 20.0
#: Bound on every wait below.
WAIT_S = 60.0
TRANSPORTS = ["mooncake", "nixl", "nixl-push"]


def _resolves(yes: bool) -> None:
    """Make :data:`NAME` resolve to loopback, or not at all. Written in place: the bind
    mount is of this file's inode, and glibc reads the file at every lookup."""
    assert _HOSTS_FILE is not None
    entry = f"127.0.0.1 {NAME}\n" if yes else ""
    Path(_HOSTS_FILE).write_text(f"127.0.0.1 localhost\n::1 localhost\n{entry}")


def _by_name(transport: str, params: dict[str, object]) -> dict[str, object]:
    """P's params with P's address replaced by :data:`NAME`."""
    if transport.startswith("nixl"):
        return with_param(params, "remote_host", NAME)
    addr = str(params["remote_bootstrap_addr"])
    return with_param(params, "remote_bootstrap_addr", re.sub(r"127\.0\.0\.1", NAME, addr))


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request: pytest.FixtureRequest) -> Iterator[PeerPair]:
    if _HOSTS_FILE is None:
        pytest.skip("runs in the child with its own resolver (see the module's last test)")
    extra = {"kvfail_deadline_s": DEADLINE_S}
    p: PeerPair
    if request.param == "nixl-push":
        install_exit_guard(request.config)
        p = NixlPushPair(extra_config=extra, build_default_consumer=False)
    elif request.param == "nixl":
        install_exit_guard(request.config)
        p = NixlPair(
            connector="KvfailNixlConnector",
            connector_module="connectors.nixl",
            extra_config=extra,
            build_default_consumer=False,
        )
    else:
        p = MooncakePair(
            policy="fail",
            connector="KvfailMooncakeConnector",
            connector_module="connectors.mooncake",
            p_connector="MooncakeConnector",
            extra_config=extra,
        )
    try:
        yield p
    finally:
        p.close()


def _load(pair: PeerPair, engine: Engine, rid: str) -> None:
    """P prefills ``rid``; D loads it through P's name, until its report (bounded)."""
    params = _by_name(pair.transport, pair.prefill(rid, 80))
    pair.add(rid, params, prompt_len=80, consumer=engine)
    run = pair.run([rid], consumer=engine, timeout_s=WAIT_S)
    assert run.ok, (run, pair.records[rid])


def test_loads_reach_p_by_its_name(pair: PeerPair) -> None:
    _resolves(True)
    engine = pair.consumer("fail", name="by-name")
    rid = f"name-ok-{pair.transport}"
    _load(pair, engine, rid)
    assert not pair.records[rid].failed and pair.verify(rid), pair.records[rid]
    assert oracles.check_all(engine, [rid], failed=False) == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_name_that_stops_resolving_fails_the_load_once_and_d_serves_on(
    pair: PeerPair, policy: str
) -> None:
    """A D that has not reached P yet (cold): its load needs the name. Gone, the load is
    failed once, in the policy's way, and its blocks come back (nothing was sent to P,
    so nothing can be written); D's engine keeps stepping. Once the name resolves again,
    the same D loads through it."""
    _resolves(False)
    engine = pair.consumer(policy, name=f"cold-{policy}")
    rid = f"name-gone-{pair.transport}-{policy}"
    try:
        _load(pair, engine, rid)
    finally:
        _resolves(True)
    assert pair.records[rid].failed, pair.records[rid]
    step_until(pair, engine, lambda: all_blocks_free(engine), "every block back", WAIT_S)
    assert oracles.check_all(engine, [rid], failed=True) == []
    again = f"name-back-{pair.transport}-{policy}"
    _load(pair, engine, again)
    assert not pair.records[again].failed and pair.verify(again), pair.records[again]
    assert oracles.check_all(engine, [again], failed=False) == []


def test_a_p_name_that_stops_resolving_in_a_process_with_its_own_resolver(
    tmp_path: Path,
) -> None:
    """Runs the module's checks in a child whose ``/etc/hosts`` and ``/etc/nsswitch.conf``
    are this test's files, in a mount namespace of its own (nothing changes for the rest
    of the machine)."""
    if _HOSTS_FILE is not None:
        return  # the child itself
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("requires root and unshare(1) for a private mount namespace")
    hosts, nsswitch = tmp_path / "hosts", tmp_path / "nsswitch.conf"
    hosts.write_text("127.0.0.1 localhost\n::1 localhost\n")
    nsswitch.write_text("hosts: files\n")
    mount = (
        'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/nsswitch.conf && '
        'shift 2 && exec "$@"'
    )
    rc, out = run_child_pytest(
        [__file__, "-o", "addopts=", "-p", "no:randomly", "-k", "not own_resolver"],
        cwd=ROOT,
        timeout_s=600,
        env={HOSTS_FILE_ENV: str(hosts)},
        prefix=[
            *("unshare", "-m", "--propagation", "private"),
            *("sh", "-c", mount, "sh", str(hosts), str(nsswitch)),
        ],
    )
    assert rc == 0 and re.search(r"\b9 passed", out), out[-6000:]
