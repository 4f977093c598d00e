"""PeerProcess against real child processes: signals, readiness, and leak-free cleanup.

Process state is checked straight from /proc rather than through the code under test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvfail.rig.ports import free_port, free_ports, wait_for_port
from kvfail.rig.processes import PeerExitedError, PeerProcess, close_all, live_peers
from kvfail.rig.procfs import busiest_processes, busy_threads, spinning_threads
from kvfail.rig.stacks import STACK_SIGNAL, native_stacks, summarize_native, summarize_stacks
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_S = 15.0  # only reached when broken; a cold python start on a loaded box is slow
SLEEPER = "import time; print('READY', flush=True); time.sleep(60)"
WITH_GRANDCHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    print('GRANDCHILD', g.pid, flush=True)
    print('READY', flush=True)
    time.sleep(60)
    """
)


#: A process with one thread stuck in a loop (a wedged P's spinning transport thread).
SPIN = textwrap.dedent(
    """
    import threading, time
    def loop():
        while True:
            pass
    threading.Thread(target=loop, daemon=True).start()
    time.sleep(60)
    """
)


def py(code: str, **kw: object) -> PeerProcess:
    return PeerProcess([sys.executable, "-c", code], **kw)  # type: ignore[arg-type]


def stat_state(pid: int) -> str | None:
    """State letter from /proc/PID/stat, read independently of the library."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()[0]


def ignores_sigterm(pid: int) -> bool:
    """SigIgn from /proc/PID/status, read independently of the library."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def gone(pid: int) -> bool:
    # An orphan may stay a zombie if PID 1 in this container does not reap: dead all the same.
    return stat_state(pid) in (None, "Z", "X")


def test_freeze_thaw_kill() -> None:
    with py(SLEEPER, name="sleeper") as peer:
        assert peer.wait_ready(READY_S, line="READY") == "READY"
        assert peer.alive

        peer.freeze()
        assert stat_state(peer.pid) == "T"
        assert peer.frozen and peer.alive

        peer.thaw()
        assert stat_state(peer.pid) not in (None, "T")
        assert not peer.frozen

        assert peer.kill() == -signal.SIGKILL
        assert not peer.alive
        assert peer.returncode == -9
        assert stat_state(peer.pid) is None  # reaped, not a zombie


def test_kill_a_frozen_peer() -> None:
    with py(SLEEPER) as peer:
        peer.wait_ready(READY_S, line="READY")
        peer.freeze()
        assert peer.kill() == -9


def test_close_of_frozen_peer_leaves_nothing() -> None:
    peer = py(WITH_GRANDCHILD)
    try:
        line = peer.wait_ready(READY_S, line=re.compile(r"^GRANDCHILD \d+$"))
        assert line is not None
        grandchild = int(line.split()[1])
        peer.freeze()
        assert stat_state(peer.pid) == "T"
        assert stat_state(grandchild) == "T"  # the whole group is frozen
    finally:
        rc = peer.close()
    # SIGCONT then SIGTERM is enough for a default python: no SIGKILL needed.
    assert rc == -signal.SIGTERM
    assert stat_state(peer.pid) is None
    assert wait_until(lambda: gone(grandchild))
    assert peer not in live_peers()
    assert peer.close() == rc  # idempotent


def test_group_kill_also_kills_grandchild() -> None:
    with py(WITH_GRANDCHILD) as peer:
        line = peer.wait_ready(READY_S, line="GRANDCHILD")
        assert line is not None
        grandchild = int(line.split()[1])
        assert not gone(grandchild)
        assert {peer.pid, grandchild} <= set(peer.group_members())
        peer.kill()
        assert wait_until(lambda: gone(grandchild))
        assert peer.group_members() == []


def test_kill_leader_only_leaves_grandchild_for_close() -> None:
    peer = py(WITH_GRANDCHILD)
    try:
        line = peer.wait_ready(READY_S, line="GRANDCHILD")
        assert line is not None
        grandchild = int(line.split()[1])
        peer.kill(group=False)
        assert not gone(grandchild)  # orphaned but alive
    finally:
        peer.close(grace_s=0.2)
    assert wait_until(lambda: gone(grandchild))  # close() reaches the orphan via its group


def test_close_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('READY', flush=True); time.sleep(60)"
    )
    peer = py(code)
    peer.wait_ready(READY_S, line="READY")
    assert ignores_sigterm(peer.pid)  # so only the escalation to SIGKILL can end it
    assert peer.close(grace_s=0.2) == -signal.SIGKILL
    assert stat_state(peer.pid) is None  # reaped: close() returned on the kill


def test_wait_ready_fails_fast_when_the_peer_exits() -> None:
    with py("import sys; print('boom'); sys.exit(3)") as peer:
        with pytest.raises(PeerExitedError) as err:
            peer.wait_ready(READY_S, line="READY")
        assert err.value.returncode == 3
        assert "boom" in str(err.value)


def test_ready_line_printed_just_before_exit_is_seen() -> None:
    with py("print('READY and gone')") as peer:
        assert peer.wait_ready(READY_S, line="READY") == "READY and gone"


def test_wait_ready_times_out() -> None:
    with py(SLEEPER) as peer, pytest.raises(TimeoutError):
        peer.wait_ready(0.3, line="never printed")


def test_wait_ready_on_stderr_file_and_predicate(tmp_path: Path) -> None:
    flag = tmp_path / "ready.txt"
    code = textwrap.dedent(
        f"""
        import sys, time
        print('ERR-READY', file=sys.stderr, flush=True)
        time.sleep(0.1)
        open({str(flag)!r}, 'w').write('booting\\nPORT=4242\\n')
        time.sleep(60)
        """
    )
    with py(code) as peer:
        assert peer.wait_ready(READY_S, line="ERR-READY", stream="stderr") == "ERR-READY"
        assert peer.wait_ready(READY_S, line=re.compile(r"PORT=\d+"), path=flag) == "PORT=4242"
        assert peer.wait_ready(READY_S, predicate=flag.exists) is None
        assert "ERR-READY" in peer.stderr_lines()
    with pytest.raises(ValueError):
        peer.wait_ready(1.0)  # neither line nor predicate


def test_stdin_commands() -> None:
    code = "import sys\nfor line in sys.stdin: print(line.strip().upper(), flush=True)"
    with py(code, stdin=True) as peer:
        peer.write_stdin("ping\n")
        assert peer.wait_ready(READY_S, line="PING") == "PING"


def test_output_since_a_marker_has_only_the_newer_lines() -> None:
    """A failing scenario shows what its peer printed while it ran, not before."""
    code = (
        "import sys\n"
        "for line in sys.stdin:\n"
        "    print('out', line.strip(), flush=True)\n"
        "    print('err', line.strip(), file=sys.stderr, flush=True)"
    )
    with py(code, stdin=True) as peer:
        peer.write_stdin("1\n")
        assert wait_until(lambda: "err 1" in peer.output_since())
        marker = peer.output_marker()
        peer.write_stdin("2\n")
        assert wait_until(lambda: len(peer.output_since(marker)) == 2)
        assert peer.output_since(marker) == ["out 2", "err 2"]
        assert peer.output_since() == ["out 1", "out 2", "err 1", "err 2"]
        assert peer.output_since(marker, stdout=False) == ["err 2"]


def test_busy_threads_names_the_main_thread_first() -> None:
    """A P that does not answer is shown by its busiest threads (evidence only)."""
    with py("import time\nwhile True: pass") as peer:
        shown = busy_threads([peer.pid], window_s=0.2)[peer.pid]
        assert re.fullmatch(r"main \S+ [RSD] \d+%(, \S+ [A-Z] \d+%)*", shown), shown
    assert busy_threads([peer.pid]) == {peer.pid: ""}  # gone


def test_spinning_threads_names_a_thread_stuck_in_a_loop_and_no_idle_one() -> None:
    """What marks a P as wedged after a failed scenario (``PairDriver._repair_peers``). A
    low share keeps the test about which thread, not how fast a loaded machine runs it."""
    with py(SPIN) as spinning, py("import time\ntime.sleep(60)") as idle:
        assert wait_until(lambda: len(os.listdir(f"/proc/{spinning.pid}/task")) >= 2)
        found = spinning_threads([spinning.pid, idle.pid], window_s=0.5, share=0.25)
    assert list(found) == [spinning.pid] and len(found[spinning.pid]) == 1, found
    assert re.fullmatch(rf"{spinning.pid}/\d+ \S+ \d+%", found[spinning.pid][0]), found


def test_busiest_processes_ranks_a_spinning_process_above_an_idle_one() -> None:
    """The machine-wide evidence a failed warm-up carries: who had the CPU. Ranked, not
    timed: a loaded machine gives the spinning process less, never less than nothing."""
    with py(SPIN) as spinning, py("import time\ntime.sleep(60)") as idle:
        assert wait_until(lambda: len(os.listdir(f"/proc/{spinning.pid}/task")) >= 2)
        ranked = busiest_processes(window_s=1.0, most=100_000)
    pids = [int(line.split()[0]) for line in ranked]
    assert spinning.pid in pids and idle.pid in pids, ranked
    assert pids.index(spinning.pid) < pids.index(idle.pid), ranked
    assert re.fullmatch(rf"{spinning.pid} \S+ \S \d+%", ranked[pids.index(spinning.pid)])


def test_a_peer_writes_its_stacks_on_request_one_line_per_thread() -> None:
    """What a P that does not answer is doing: its threads' Python stacks, on request."""
    code = (
        "import threading, time\n"
        "from kvfail.rig.stacks import install_stack_dump\n"
        "install_stack_dump()\n"
        "def waiter():\n    time.sleep(60)\n"
        "threading.Thread(target=waiter, daemon=True).start()\n"
        "print('READY', flush=True)\n"
        "time.sleep(60)\n"
    )
    with py(code, env={"PYTHONPATH": str(REPO_ROOT)}) as peer:
        peer.wait_ready(READY_S, line="READY")
        marker = peer.output_marker()
        os.kill(peer.pid, STACK_SIGNAL)
        assert wait_until(lambda: len(summarize_stacks(peer.output_since(marker))) == 2)
        stacks = summarize_stacks(peer.output_since(marker))
    assert any(s.startswith("Current thread 0x") and "<module>" in s for s in stacks), stacks
    assert any(s.startswith("Thread 0x") and "waiter (<string>:5)" in s for s in stacks), stacks


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (evidence only)")
def test_native_stacks_name_the_wait_one_line_per_distinct_stack() -> None:
    """Where a P that does not answer waits below Python: two threads blocked on the same
    lock are one line, the sleeping main thread another."""
    code = (
        "import threading, time\n"
        "lock = threading.Lock(); lock.acquire()\n"
        "for _ in range(2): threading.Thread(target=lock.acquire, daemon=True).start()\n"
        "print('READY', flush=True)\n"
        "time.sleep(60)\n"
    )
    with py(code) as peer:
        peer.wait_ready(READY_S, line="READY")
        stacks = native_stacks(peer.pid)
    lock_waits = [s for s in stacks if "PyThread_acquire_lock" in s]
    assert len(lock_waits) == 1 and "(+1 alike)" in lock_waits[0], stacks
    assert any("time_sleep" in s for s in stacks), stacks
    gone = native_stacks(peer.pid)
    assert gone == [] or all("no native" in s for s in gone), gone


def test_summarize_native_keeps_library_frames_and_drops_the_interpreter() -> None:
    gdb_output = [
        'Thread 2 (Thread 0x7f00 (LWP 11) "ucx-progress"):',
        "#0  0x1 in __GI___poll (fds=0x1, nfds=2) at poll.c:29",
        "#1  0x2 in nixlUcxSharedThread::run() () from /x/libplugin_UCX.so",
        "#2  0x3 in start_thread (arg=0x0) at pthread_create.c:442",
        'Thread 1 (Thread 0x7f01 (LWP 10) "python"):',
        "#0  0x4 in do_futex_wait (sem=0x1) at sem_waitcommon.c:111",
        "#1  0x5 in PyThread_acquire_lock_timed (lock=0x1) at thread_pthread.h:481",
        "#2  0x6 in _PyEval_EvalFrameDefault (tstate=0x1) at ceval.c:4769",
        "#3  0x7 in nixlAgent::getNotifs(std::map<a, b>&, c) const () from /x/libnixl.so.0",
    ]
    assert summarize_native(gdb_output, 10) == [
        "10 ucx-progress/11: nixlUcxSharedThread::run[libplugin_UCX]",
        "10 python/10: do_futex_wait < PyThread_acquire_lock_timed < nixlAgent::getNotifs[libnixl]",
    ]


def test_free_ports_and_wait_for_port() -> None:
    ports = free_ports(3)
    assert len(set(ports)) == 3
    port = free_port()
    code = textwrap.dedent(
        f"""
        import socket, time
        s = socket.socket(); s.bind(('127.0.0.1', {port})); time.sleep(0.1); s.listen()
        print('LISTENING', flush=True); time.sleep(60)
        """
    )
    with py(code) as peer:
        wait_for_port(port, READY_S, peer=peer)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        # Frozen, it still "accepts": the kernel completes the handshake (the silent peer).
        peer.freeze()
        wait_for_port(port, READY_S)
    with pytest.raises(TimeoutError):
        wait_for_port(port, 0.3)
    with pytest.raises(ValueError):
        wait_for_port(port, 0.1, host="8.8.8.8")


def test_wait_for_port_fails_fast_on_dead_peer() -> None:
    with py("import sys; sys.exit(1)") as peer, pytest.raises(PeerExitedError):
        wait_for_port(free_port(), READY_S, peer=peer)


def test_close_all_closes_registered_peers() -> None:
    peers = [py(SLEEPER) for _ in range(2)]
    assert set(peers) <= set(live_peers())
    close_all(grace_s=0.2)
    assert not live_peers()
    assert all(p.returncode is not None for p in peers)


def test_atexit_hook_kills_leaked_peers() -> None:
    """A script that forgets close(): its peer and grandchild must die with the interpreter."""
    script = textwrap.dedent(
        f"""
        import sys
        from kvfail.rig.processes import PeerProcess
        p = PeerProcess([sys.executable, '-c', {WITH_GRANDCHILD!r}])
        line = p.wait_ready({READY_S}, line='GRANDCHILD')
        print(p.pid, line.split()[1], flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO_ROOT,
        check=True,
    )
    child, grandchild = (int(x) for x in out.stdout.split())
    assert wait_until(lambda: gone(child) and gone(grandchild)), out.stderr


#: A runner that starts one peer and waits; argv[1] says whether it installs the handler.
RUNNER_WITH_PEER = textwrap.dedent(
    """
    import sys, time
    from kvfail.rig.processes import PeerProcess
    from kvfail.rig.processes import close_peers_on_sigterm
    if sys.argv[1] == "install":
        assert close_peers_on_sigterm()
    peer = PeerProcess([sys.executable, '-c', 'import time; time.sleep(60)'], name='orphan?')
    print('PEER', peer.pid, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("install", [True, False], ids=["handler", "default-sigterm"])
def test_sigterm_to_the_runner_closes_its_peers(install: bool) -> None:
    """``timeout`` and CI stop a test run with SIGTERM. With the handler the run unwinds
    and ``atexit`` closes its peers; with Python's default SIGTERM (the control) the peer,
    in its own process group, is orphaned."""
    runner = PeerProcess(
        [sys.executable, "-c", RUNNER_WITH_PEER, "install" if install else "plain"],
        name="runner",
        cwd=REPO_ROOT,
    )
    peer_pid = None
    try:
        line = runner.wait_ready(READY_S, line=re.compile(r"^PEER \d+$"))
        assert line is not None
        peer_pid = int(line.split()[1])
        os.kill(runner.pid, signal.SIGTERM)  # the runner only, as `timeout` does
        assert wait_until(lambda: not runner.alive, 10.0)
        if install:
            assert wait_until(lambda: gone(peer_pid), 10.0), "SIGTERM orphaned the peer"
        else:
            time.sleep(0.5)
            assert not gone(peer_pid), "the control lost its peer: the test proves nothing"
    finally:
        runner.close()
        if peer_pid is not None and not gone(peer_pid):
            os.kill(peer_pid, signal.SIGKILL)
