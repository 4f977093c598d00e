"""The harness engine's processes run torch with one intra-op thread unless the user chose.

Why it matters: the harness's forward and byte oracles are small tensor operations, which
a thread per core only slows down (``kvfail.harness.threads``); and a user's own
``OMP_NUM_THREADS`` or ``KVFAIL_TORCH_THREADS`` must still win.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfail.harness.threads import TORCH_THREADS_ENV

_PROBE = (
    "import torch; from kvfail.harness.threads import set_harness_threads; "
    "torch.set_num_threads(2); print(set_harness_threads(), torch.get_num_threads())"
)


def _probe(**env: str) -> tuple[int, int]:
    """(what ``set_harness_threads`` returns, torch's pool after it) in a fresh process
    whose pool starts at two threads, with only ``env`` of the two variables set."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", TORCH_THREADS_ENV)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return int(out[-2]), int(out[-1])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (1, 1)),
        ({"OMP_NUM_THREADS": "2"}, (2, 2)),
        ({TORCH_THREADS_ENV: "2"}, (2, 2)),
        ({TORCH_THREADS_ENV: "1", "OMP_NUM_THREADS": "2"}, (1, 1)),
    ],
)
def test_one_thread_unless_the_user_chose(env: dict[str, str], expected: tuple[int, int]) -> None:
    assert _probe(**env) == expected
