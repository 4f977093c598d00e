"""Names for the shared-memory segments of harness TP worlds, and their removal.

Why here (no vLLM import): vLLM's CPU communicator gives each TP world shared-memory
segments in /dev/shm named after ``VLLM_DIST_IDENT``, and they outlive the processes (a
rank exits with ``os._exit`` or is SIGKILLed by a one-rank fault). Left alone, every TP
engine a test builds leaves megabytes behind, and a later world reusing a name fails
with EEXIST. So every harness world gets a unique name under one prefix per top-level
process (inherited by the peer processes it starts), the engine removes its own segments
when it closes, and the pytest plugin sweeps the prefix at the end of the session for
those of engines that were killed. vLLM's IPC socket files get the same treatment: one
directory per session (:func:`session_ipc_dir`), removed when the session ends.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

__all__ = [
    "new_shm_ident",
    "release_ipc_dir",
    "release_orphans",
    "release_shared_memory",
    "segment_names",
    "session_ipc_dir",
    "session_prefix",
]

PREFIX_ENV = "KVFAIL_SHM_PREFIX"
_SHM_DIR = Path("/dev/shm")


def session_prefix() -> str:
    """This process tree's prefix (set once, inherited by the processes it starts)."""
    return os.environ.setdefault(PREFIX_ENV, f"kvfail{os.getpid()}")


def owns_session_prefix() -> bool:
    """True in the process that created the prefix (the one that should sweep it)."""
    return os.environ.get(PREFIX_ENV) == f"kvfail{os.getpid()}"


#: vLLM names its ZeroMQ IPC endpoints (a TP world's message queue, an engine's RPC) as
#: socket files under this directory; a rank that ends with ``os._exit`` or SIGKILL never
#: unlinks them, so each session gets a directory of its own that it removes at the end.
IPC_ENV = "VLLM_RPC_BASE_PATH"
_IPC_OWNER_ENV = "KVFAIL_IPC_OWNER"


def session_ipc_dir() -> str:
    """This process tree's directory for vLLM's IPC socket files (created once, inherited
    by the processes it starts). A directory the user set is used as it is, never removed."""
    if os.environ.get(IPC_ENV):
        return os.environ[IPC_ENV]
    import tempfile

    path = tempfile.mkdtemp(prefix=f"{session_prefix()}-ipc-")
    os.environ[IPC_ENV] = path
    os.environ[_IPC_OWNER_ENV] = f"{os.getpid()}:{path}"
    return path


def release_ipc_dir() -> bool:
    """Remove the IPC directory this process created (no-op elsewhere); True if removed."""
    import shutil

    owner, _, path = os.environ.get(_IPC_OWNER_ENV, "").partition(":")
    if owner != str(os.getpid()) or not path:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def new_shm_ident() -> str:
    """A unique ``VLLM_DIST_IDENT`` for one engine's TP world."""
    return f"{session_prefix()}-{uuid.uuid4().hex[:12]}"


def release_shared_memory(ident: str) -> int:
    """Unlink every segment named after ``ident`` (an engine's, or a whole prefix);
    returns how many. Unlinking a segment still mapped is harmless: only its name goes."""
    removed = 0
    for path in _SHM_DIR.glob(f"{ident}-*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed


#: Name prefixes of Python's ``multiprocessing`` objects in /dev/shm: ``shared_memory``
#: segments (vLLM's message queues, scheduler -> workers) and named semaphores (its
#: multiprocessing locks). A ``vllm serve`` that is SIGKILLed leaves both behind under
#: random names we cannot predict.
ANON_PREFIX: tuple[str, ...] = ("psm_", "sem.mp-")

#: How long an end-of-session sweep keeps looking at segments still mapped: a killed
#: server's (or a closed P's) child processes unmap theirs only as they exit.
EXIT_WAIT_S = 10.0


def segment_names(prefix: str | tuple[str, ...] = ANON_PREFIX) -> set[str]:
    """The /dev/shm names that start with ``prefix`` now."""
    try:
        return {p.name for p in _SHM_DIR.iterdir() if p.name.startswith(prefix)}
    except OSError:
        return set()


def _inodes_in_use() -> set[int]:
    """Inodes under /dev/shm that some live process maps or holds open. Inodes, not names:
    glibc's ``sem_open`` maps a temporary file and then links it to the semaphore's name, so
    the mapping shows a deleted temporary name while the inode is the named file's."""
    used: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    used.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith("/dev/shm/"):
                        used.add(os.stat(fd).st_ino)
    return used


def _unused(names: set[str]) -> set[str]:
    used = _inodes_in_use()
    unused = set()
    for name in names:
        with contextlib.suppress(OSError):
            if (_SHM_DIR / name).stat().st_ino not in used:
                unused.add(name)
    return unused


def release_orphans(
    before: set[str],
    prefix: str | tuple[str, ...] = ANON_PREFIX,
    settle_s: float = 0.2,
    wait_s: float = 0.0,
) -> int:
    """Unlink segments named ``prefix*`` (one prefix or several) that appeared since
    ``before`` was taken and that no live process uses any more: what killed servers left.
    A segment must be unused in two looks ``settle_s`` apart (a process may be between
    creating and mapping it; its age says nothing, as a live queue's writes keep its mtime
    fresh). ``wait_s``: keep looking that long for segments still in use, for processes
    that are still exiting (a killed server's children unmap theirs only as they go)."""
    import time

    end = time.monotonic() + wait_s
    removed = 0
    while True:
        candidates = segment_names(prefix) - before
        unused = _unused(candidates) if candidates else set()
        if unused:
            time.sleep(settle_s)
            unused = _unused(unused)
        for name in unused:
            with contextlib.suppress(OSError):
                (_SHM_DIR / name).unlink()
                removed += 1
        if not candidates - unused or time.monotonic() >= end:
            return removed
        time.sleep(0.25)
