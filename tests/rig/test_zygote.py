"""The zygote against real forked peers: what PeerProcess sees must not change.

A peer forked from a zygote must behave as a ``python -m`` child does under every fault
the suite applies (SIGKILL, SIGSTOP/SIGCONT, its own session), see its own environment and
argv, talk over stdin/stdout, and report its exit status, even once the zygote is gone.
Process state is read from /proc, not through the code under test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfail.rig.processes import PeerProcess
from kvfail.rig.procfs import proc_state
from kvfail.rig.zygote import Zygote, ZygoteError

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import zprobe_heavy
    print("ready", json.dumps([os.getpid(), os.getpgid(0), os.environ.get("PROBE"),
          sys.argv[1:], zprobe_heavy.IMPORTED_IN, os.environ.get("HOOKED")]), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            sys.exit(3)
        print("echo", line.strip(), flush=True)
    """
)
#: Stands for vLLM: imported once, in the zygote, and only inherited by the children.
HEAVY = "import os\nIMPORTED_IN = os.getpid()\n"
HOOK = "import os\ndef mark():\n    os.environ['HOOKED'] = str(os.getpid())\n"


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    (tmp_path / "zprobe.py").write_text(PROBE)
    (tmp_path / "zprobe_heavy.py").write_text(HEAVY)
    (tmp_path / "zprobe_hook.py").write_text(HOOK)
    z = Zygote(["zprobe_heavy"], env={"PYTHONPATH": str(tmp_path)}, ready_timeout_s=60.0)
    yield z
    z.close()


def _peer(zygote: Zygote, *args: str, **env: str) -> PeerProcess:
    return PeerProcess(
        [sys.executable, "-m", "zprobe", *args],
        name="zprobe",
        env=env,
        stdin=True,
        zygote=zygote,
        before=["zprobe_hook:mark"],
    )


def _ready(peer: PeerProcess) -> list[Any]:
    line = peer.wait_ready(30.0, line="ready")
    assert line is not None
    fields: list[Any] = json.loads(line.partition(" ")[2])
    return fields


def test_child_leads_its_own_group_in_our_session_with_its_env_argv_and_hooks(
    zygote: Zygote,
) -> None:
    with _peer(zygote, "--x", "1", PROBE="yes") as peer:
        pid, pgid, probe, argv, imported_in, hooked = _ready(peer)
        assert pid == peer.pid != zygote.pid
        assert pgid == peer.pid  # its own group, for killpg
        # ... in our session: a session of its own is a scheduling group of its own.
        assert os.getsid(peer.pid) == os.getsid(0)
        assert probe == "yes"
        assert argv == ["--x", "1"]
        assert imported_in == zygote.pid  # the heavy import was paid once, upstream
        assert int(hooked) == peer.pid  # the hook ran in the child, before the module


def test_stdin_stdout_and_exit_code(zygote: Zygote) -> None:
    with _peer(zygote) as peer:
        _ready(peer)
        peer.write_stdin("hello\n")
        assert peer.wait_ready(30.0, line="echo hello") == "echo hello"
        peer.write_stdin("exit\n")
        assert peer.wait(30.0) == 3
        assert not peer.alive and peer.returncode == 3


def test_kill_freeze_and_thaw_reach_the_forked_peer(zygote: Zygote) -> None:
    peer = _peer(zygote)
    try:
        _ready(peer)
        peer.freeze()
        assert proc_state(peer.pid) in ("T", "t")
        peer.thaw()
        peer.write_stdin("after-thaw\n")
        peer.wait_ready(30.0, line="echo after-thaw")
        assert peer.kill() == -signal.SIGKILL
        assert proc_state(peer.pid) is None  # reaped by the zygote, gone from /proc
    finally:
        peer.close()


def test_exit_is_seen_after_the_zygote_died(zygote: Zygote) -> None:
    peer = _peer(zygote)
    try:
        _ready(peer)
        os.killpg(zygote.pid, signal.SIGKILL)  # the zygote's own group, not the peer's
        peer.write_stdin("still-here\n")
        peer.wait_ready(30.0, line="echo still-here")
        with pytest.raises(ZygoteError):
            _peer(zygote)
        peer.send_signal(signal.SIGKILL)
        peer.wait(30.0)
        assert not peer.alive
    finally:
        peer.close()


def test_only_python_dash_m_is_forked(zygote: Zygote) -> None:
    with pytest.raises(ValueError, match="python -m"):
        PeerProcess([sys.executable, "-c", "pass"], zygote=zygote)


def test_a_preload_that_fails_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "zprobe_broken.py").write_text("raise ImportError('no such transport')\n")
    with pytest.raises(ZygoteError, match="no such transport"):
        Zygote(["zprobe_broken"], env={"PYTHONPATH": str(tmp_path)}, ready_timeout_s=60.0)
