"""The exit guard of a process that created a NIXL agent.

The nixl teardown segfault. Any process that created a nixl UCX agent segfaults in
``_dl_fini`` at a normal interpreter exit (rc 139), so a process holding D engines must
end with ``os._exit``. :func:`install_exit_guard` (called when the first D is built)
registers an ``atexit`` handler that flushes stdio and calls ``os._exit`` with the
process's real exit status: pytest's session status (recorded by
:mod:`kvfail.rig.exit_status`, which kvfail's plugin puts on every session), else 1 after
an uncaught exception, else the ``sys.exit`` code. Other ``atexit`` handlers registered
*before* it still run (LIFO); later ones are skipped, which is why it is installed as late
as possible.

Apart from :mod:`kvfail.peers.nixl` because ending the process is not the pair's job: any
process that builds a NIXL D installs it, the pair only calls it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from typing import Any

from kvfail.rig import exit_status

__all__ = ["install_exit_guard"]


class _ExitGuard:
    """Ends this process with ``os._exit(status)`` instead of a segfaulting normal exit."""

    def __init__(self) -> None:
        self.installed = False
        self.sys_exit_code: int | None = None
        self.uncaught = False
        self._lock = threading.Lock()

    def install(self, config: Any = None) -> None:
        # kvfail's plugin watches every session at configure; these cover a run with the
        # plugin disabled. A config passed in is watched on every call (cheap: a later
        # call may bring a session the first did not know); the heap scan runs once, as
        # it walks every object the collector tracks and a D is built per call.
        if config is not None:
            with contextlib.suppress(Exception):
                exit_status.watch(config)
        with self._lock:
            if self.installed:
                return
            self.installed = True
        for each in _running_pytest_configs():
            with contextlib.suppress(Exception):
                exit_status.watch(each)
        previous_hook = sys.excepthook

        def excepthook(*args: Any) -> None:
            self.uncaught = True
            previous_hook(*args)

        sys.excepthook = excepthook
        real_exit = sys.exit

        def recording_exit(code: Any = None) -> None:
            self.sys_exit_code = _code_of(code)
            real_exit(code)

        sys.exit = recording_exit  # type: ignore[assignment]
        atexit.register(self._exit)

    def status(self) -> int:
        pytest_status = exit_status.pytest_status()
        if pytest_status is not None:
            return pytest_status
        if self.uncaught:
            return 1
        return self.sys_exit_code or 0

    def _exit(self) -> None:
        code = self.status()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _code_of(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints it and exits 1


def _running_pytest_configs() -> list[Any]:
    """The live ``pytest.Config`` objects the collector still tracks (a fallback: objects
    frozen by ``gc.freeze`` are invisible here, which is why sessions are watched at
    configure by kvfail's plugin)."""
    if "_pytest.config" not in sys.modules:
        return []
    from _pytest.config import Config

    # ``type(o) is``, not isinstance: isinstance reads ``__class__``, which some lazy
    # objects (torch, vLLM) turn into imports and deprecation warnings.
    return [o for o in gc.get_objects() if type(o) is Config]


_GUARD = _ExitGuard()


def install_exit_guard(config: Any = None) -> None:
    """Make this process end with ``os._exit(<its real status>)`` (see the module doc).

    Idempotent. Pass the pytest ``config`` when at hand; otherwise it is looked up once.
    """
    _GUARD.install(config)
