"""``kvfail.rig.shm.release_orphans``: what a SIGKILLed server leaves in /dev/shm goes; what a
live process still maps and what existed before stay."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from kvfail.rig import shm

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")

_HOLD = (
    "import sys\n"
    "from multiprocessing import resource_tracker, shared_memory\n"
    "s = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=4096)\n"
    "resource_tracker.unregister(s._name, 'shared_memory')\n"
    "print('up', flush=True)\n"
    "sys.stdin.read()\n"
)


def _segment(name: str) -> None:
    """Create a segment and drop every handle to it, as a killed process would."""
    seg = shared_memory.SharedMemory(name=name, create=True, size=4096)
    from multiprocessing import resource_tracker

    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    seg.close()


def test_only_new_unused_segments_go() -> None:
    tag = f"kvfailtest{os.getpid()}_"
    existing, orphan, held = (f"{tag}{k}" for k in ("old", "orphan", "held"))
    _segment(existing)
    before = shm.segment_names(tag)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, held], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"up"
        _segment(orphan)
        removed = shm.release_orphans(before, prefix=tag)
        left = shm.segment_names(tag)
        assert removed == 1
        assert left == {existing, held}
    finally:
        holder.kill()
        holder.wait(timeout=10)
        for path in Path("/dev/shm").glob(f"{tag}*"):
            path.unlink()


_SEMAPHORE = (
    "import sys, _multiprocessing\n"
    "sem = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False)  # named, never unlinked\n"
    "print('up', flush=True)\n"
    "if sys.argv[2] == 'hold':\n"
    "    sys.stdin.read()\n"
)


@contextlib.contextmanager
def _holding_semaphore(tag: str) -> Iterator[subprocess.Popen[bytes]]:
    """A live process that keeps the named semaphore ``/<tag>held`` mapped; afterwards it
    is killed and every ``sem.<tag>*`` is removed, whatever the test left."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _SEMAPHORE, f"/{tag}held", "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"up"
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=10)
        for path in Path("/dev/shm").glob(f"sem.{tag}*"):
            path.unlink()


def test_a_killed_processs_named_semaphore_goes_and_a_held_one_stays() -> None:
    """multiprocessing's named semaphores (``sem.mp-*``) outlive a SIGKILLed server too;
    one that a live process still has mapped is left alone."""
    tag = f"mp-kvfailtest{os.getpid()}"
    prefix = f"sem.{tag}"
    before = shm.segment_names(prefix)
    with _holding_semaphore(tag):
        gone = subprocess.run(
            [sys.executable, "-c", _SEMAPHORE, f"/{tag}orphan", "exit"],
            capture_output=True,
            timeout=30,
            check=True,
        )
        assert gone.stdout.strip() == b"up"
        assert shm.segment_names(prefix) - before == {f"{prefix}held", f"{prefix}orphan"}
        assert shm.release_orphans(before, prefix=prefix) == 1
        assert shm.segment_names(prefix) - before == {f"{prefix}held"}


def test_the_sweep_waits_for_a_segment_whose_last_user_is_still_exiting() -> None:
    """A killed server's children unmap their queues only as they exit: with ``wait_s``
    the sweep keeps looking and removes the segment once its last user is gone."""
    tag = f"mp-kvfailwait{os.getpid()}"
    prefix = f"sem.{tag}"
    before = shm.segment_names(prefix)
    with _holding_semaphore(tag) as holder:
        assert shm.release_orphans(before, prefix=prefix) == 0  # still mapped: kept
        threading.Timer(0.5, holder.kill).start()  # the last user exits while we wait
        assert shm.release_orphans(before, prefix=prefix, wait_s=30.0) == 1
        assert shm.segment_names(prefix) == before


def test_the_ipc_directory_is_the_sessions_own_and_goes_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's IPC socket files land in a directory the session made, and only the process
    that made it removes it; a directory the user chose is never touched."""
    monkeypatch.delenv(shm.IPC_ENV, raising=False)
    monkeypatch.delenv("KVFAIL_IPC_OWNER", raising=False)
    path = Path(shm.session_ipc_dir())
    assert os.environ[shm.IPC_ENV] == str(path) and path.is_dir()
    assert shm.session_ipc_dir() == str(path)  # once per process tree
    (path / "a-socket-file").write_text("")
    monkeypatch.setenv("KVFAIL_IPC_OWNER", f"{os.getpid() + 1}:{path}")  # a child's view
    assert shm.release_ipc_dir() is False and path.is_dir()
    monkeypatch.setenv("KVFAIL_IPC_OWNER", f"{os.getpid()}:{path}")
    assert shm.release_ipc_dir() is True and not path.exists()


def test_a_user_chosen_ipc_directory_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(shm.IPC_ENV, str(tmp_path))
    monkeypatch.delenv("KVFAIL_IPC_OWNER", raising=False)
    assert shm.session_ipc_dir() == str(tmp_path)
    assert shm.release_ipc_dir() is False and tmp_path.is_dir()
