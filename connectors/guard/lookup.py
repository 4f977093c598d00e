"""The scheduler's calls into the inner connector that can wait on a remote, bounded.

Why: vLLM calls ``get_num_new_matched_tokens`` on its one scheduler thread. A connector
whose lookup asks a remote (MooncakeStore asks its master through the worker's lookup
server) stops every request of the engine while that remote does not answer, and no load
deadline helps: nothing was loaded yet. So the guard runs such a call on a thread of its
own and waits at most the lookup deadline. Past it the caller gets no answer (the guard
then answers "nothing to load": D computes the prefix itself), and the call is *stuck*:
while it has not returned, every further bounded call is refused at once (a breaker per
inner connector, closed when the stuck call returns). One call at a time runs, so the
inner never sees two of its lookups at once, as it would not alone.

A stuck call's result, when it comes, is dropped: the request it was for has had its
answer. What the inner recorded for that request in the meantime is the inner's, and
vLLM's contract already covers it: the scheduler tells the inner 0 external tokens for it
(``update_state_after_alloc``), or nothing at all when it did not allocate, and in both
cases a connector must not load (docs/guard.md says what this assumes of the inner).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BoundedCalls", "CallOutcome"]

logger = logging.getLogger("kvfail.guard")


@dataclass
class CallOutcome:
    """What a bounded call gave: ``done`` with its ``value``, or not done (timed out, or
    refused because an earlier call is stuck)."""

    done: bool
    value: Any = None
    timed_out: bool = False


@dataclass
class _Job:
    what: str
    call: Callable[[], Any]
    started: float = 0.0
    finished: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    abandoned: bool = False


class BoundedCalls:
    """One thread that runs the inner's calls, one at a time, each waited on at most
    ``deadline_s``; see the module docstring."""

    def __init__(self, name: str, deadline_s: float) -> None:
        self.name = name
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: The call that passed its deadline and has not returned (the open breaker).
        self._stuck: _Job | None = None

    @property
    def stuck(self) -> str | None:
        """What the stuck call was (None: the breaker is closed)."""
        job = self._stuck
        return None if job is None else job.what

    def call(self, what: str, call: Callable[[], Any]) -> CallOutcome:
        """``call()``'s value if it returns within the deadline (its exception, raised
        here, if it raises); otherwise not done. Refused at once while a call is stuck."""
        if self._stuck is not None:
            return CallOutcome(done=False)
        job = _Job(what, call)
        self._start()
        self._jobs.put(job)
        if not job.finished.wait(self.deadline_s):
            with self._lock:
                if not job.finished.is_set():
                    job.abandoned = True
                    self._stuck = job
            if job.abandoned:
                logger.warning(
                    "kvfail guard: %s's %s did not return within %.3g s: answered "
                    "'nothing to load' (computed locally); until it returns, every lookup "
                    "of %s is answered so at once",
                    self.name,
                    what,
                    self.deadline_s,
                    self.name,
                )
                return CallOutcome(done=False, timed_out=True)
        if job.error is not None:
            raise job.error
        return CallOutcome(done=True, value=job.value)

    def close(self) -> None:
        """Let the thread end once it is free (a stuck call is not waited for)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvfail-guard-lookup[{self.name}]", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.started = time.monotonic()
            try:
                job.value = job.call()
            except BaseException as exc:  # handed to the caller, or logged if it left
                job.error = exc
            with self._lock:
                job.finished.set()
                late = job.abandoned
                if late:
                    self._stuck = None
            if late:
                logger.warning(
                    "kvfail guard: %s's stuck %s returned after %.1f s (%s); its result "
                    "is dropped, lookups go to %s again",
                    self.name,
                    job.what,
                    time.monotonic() - job.started,
                    "raised" if job.error is not None else "answered",
                    self.name,
                )
