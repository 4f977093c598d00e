"""The exit status pytest is about to give this process, for code that ends it itself.

A process that holds NIXL agents must end with ``os._exit`` (a normal exit segfaults; see
:mod:`kvfail.peers.nixl`), so whatever ends it has to pass on pytest's real status, or a
failing run exits 0. The status is recorded by :data:`RECORDER`, a tiny pytest plugin.
kvfail's pytest plugin puts it on every session at configure, nested ones included: the
sessions are found by being configured, never by scanning the heap (``gc.get_objects``
does not see what ``gc.freeze`` froze, and the suite freezes the heap after collection).

Stdlib only: the plugin imports this before anything heavy.
"""

from __future__ import annotations

from typing import Any

#: The name :data:`RECORDER` is registered under on each session's plugin manager.
PLUGIN_NAME = "kvfail-exit-status"


class SessionStatus:
    """Remembers the exit status of the last pytest session to finish in this process.

    Sessions nest (a self-test's inner ``pytest.main`` ends inside its host's), and the
    outermost ends last, so the last status written is the process's.
    """

    def __init__(self) -> None:
        self.status: int | None = None

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        # The session's own attribute: an earlier hook (kvfail's coverage gate) may have
        # failed a run whose tests all passed.
        self.status = int(getattr(session, "exitstatus", exitstatus))


RECORDER = SessionStatus()


def watch(config: Any) -> None:
    """Record ``config``'s session status from now on (idempotent per session)."""
    manager = config.pluginmanager
    if not manager.is_registered(RECORDER):
        manager.register(RECORDER, PLUGIN_NAME)


def pytest_status() -> int | None:
    """The status of the last session that finished here, or ``None`` if none has."""
    return RECORDER.status
