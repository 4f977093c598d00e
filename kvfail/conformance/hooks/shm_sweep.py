"""Shared memory a conformance session leaves: what existed before it, and the sweep.

Why here: killed peers' TP rank processes cannot unlink their segments, so the session
that started them does, once, at its end.
"""

from __future__ import annotations


def snapshot() -> None:
    """Note the segments that exist before this process's first session (once)."""
    from kvfail.rig import shm

    global _SHM_BEFORE_TAKEN
    if not _SHM_BEFORE_TAKEN:
        _SHM_BEFORE.update(shm.segment_names())
        _SHM_BEFORE_TAKEN = True


#: /dev/shm ``psm_*`` names that existed when this process's first session started (see
#: the sweep). Taken once: a session nested in it (the self-test's ``pytest.main``) must
#: not add the segments its host's live P's hold by then, or the host's sweep would never
#: look at them again once those P's are killed.
_SHM_BEFORE: set[str] = set()
_SHM_BEFORE_TAKEN = False


def sweep(*, outermost: bool) -> None:
    """Remove the TP worlds' shared memory this session left (killed peers' ranks), the
    ``psm_*`` message-queue segments of killed vLLM processes created since the session
    began that no live process uses (the IPC directory goes in ``pytest_unconfigure``).
    The ``outermost`` session keeps looking, bounded, at segments whose last users are
    still exiting (a closed P's rank processes unmap its queues only as they go)."""
    from kvfail.rig import shm

    if shm.owns_session_prefix():
        shm.release_orphans(_SHM_BEFORE, wait_s=shm.EXIT_WAIT_S if outermost else 0.0)
        shm.release_shared_memory(shm.session_prefix())
