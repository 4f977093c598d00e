"""The store driver's lookup channels are unique on the machine, not only in a process.

Why: each engine's lookup channel is an IPC path named by a number, in a directory all
processes share, and a second bind of a path takes it over. Two pytest-xdist workers
running store scenarios at once once drew overlapping numbers (a base from ``pid % 10000``
plus a count), so D asked the other worker's store and matched nothing."""

from __future__ import annotations

import subprocess
import sys

from tests.child_pytest import child_env

DRAW = (
    "import kvfail.conformance.mooncake_store_driver as m; "
    "print(*[next(m._LOOKUP_PORTS) for _ in range(200)])"
)


def _draw() -> set[int]:
    done = subprocess.run(
        [sys.executable, "-c", DRAW],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {int(n) for n in done.stdout.split()}


def test_two_processes_never_draw_the_same_lookup_channel() -> None:
    first, second = _draw(), _draw()
    assert len(first) == len(second) == 200
    assert not first & second
