"""Names for the shared-memory segments of harness TP worlds, and their removal.

Why here (no vLLM import): vLLM's CPU communicator gives each TP world shared-memory
segments in /dev/shm named after ``VLLM_DIST_IDENT``, and they outlive the processes (a
rank exits with ``os._exit`` or is SIGKILLed by a one-rank fault). Left alone, every TP
engine a test builds leaves megabytes behind, and a later world reusing a name fails
with EEXIST. So every harness world gets a unique name under one prefix per top-level
process (inherited by the peer processes it starts), the engine removes its own segments
when it closes, and the pytest plugin sweeps the prefix at the end of the session for
those of engines that were killed.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

__all__ = ["new_shm_ident", "release_shared_memory", "session_prefix"]

PREFIX_ENV = "KVFAIL_SHM_PREFIX"
_SHM_DIR = Path("/dev/shm")


def session_prefix() -> str:
    """This process tree's prefix (set once, inherited by the processes it starts)."""
    return os.environ.setdefault(PREFIX_ENV, f"kvfail{os.getpid()}")


def owns_session_prefix() -> bool:
    """True in the process that created the prefix (the one that should sweep it)."""
    return os.environ.get(PREFIX_ENV) == f"kvfail{os.getpid()}"


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
