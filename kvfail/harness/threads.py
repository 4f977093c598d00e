"""One torch thread for a harness engine's process, unless the user chose otherwise.

Why: the harness plays the model runner, and its "forward" and byte oracles are a few
small tensor operations per layer and request. On small tensors torch's intra-op thread
pool costs more in hand-offs than it saves: with a pool per core, every op pays for
waking the others. P's, D's and every rank process's engine live in processes of the
rig's own, so the rig sets the pool once per process, before the first engine is built.
An explicit ``OMP_NUM_THREADS`` (or ``KVFAIL_TORCH_THREADS``) wins.
"""

from __future__ import annotations

import os

__all__ = ["TORCH_THREADS_ENV", "set_harness_threads"]

#: Threads for torch in an engine's process, when neither this nor ``OMP_NUM_THREADS`` is
#: set: one.
TORCH_THREADS_ENV = "KVFAIL_TORCH_THREADS"


def set_harness_threads() -> int:
    """Size torch's intra-op pool for this process (see the module docstring); returns
    the size it now has."""
    import torch

    wanted = os.environ.get(TORCH_THREADS_ENV)
    if wanted is None and "OMP_NUM_THREADS" in os.environ:
        return int(torch.get_num_threads())
    threads = max(1, int(wanted or 1))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
