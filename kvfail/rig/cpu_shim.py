"""The one shim a real Mooncake worker connector needs on CPU-only torch.

Why: upstream's ``MooncakeConnectorWorker.__init__`` calls
``torch.accelerator.current_device_index()``, which raises on CPU torch ("Cannot access
accelerator device when none is available"), while ``current_platform.set_device`` right
after it is a no-op on CPU. vLLM's files are not edited: this context manager makes that
one torch call return 0 *only while a connector is being constructed*, and restores it on
exit. On a machine with an accelerator it does nothing. It is still a patch of the system
under test, so a block in which the stand-in answered is recorded as the rig patch
``cpu_accelerator_index`` (:mod:`kvfail.rig.patches`); a block in which no code asked
(a NIXL connector built inside it) changed nothing and records nothing. Used by
``connectors.mooncake``, the harness's rank processes and the peers that run upstream's
connector; importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvfail.rig import patches as rig_patches

__all__ = ["cpu_accelerator_index_shim"]


@contextlib.contextmanager
def cpu_accelerator_index_shim() -> Iterator[None]:
    """Make ``torch.accelerator.current_device_index()`` return 0 inside the block (CPU only)."""
    import torch

    accel = torch.accelerator
    if accel.is_available():
        yield
        return
    original = accel.current_device_index
    calls = 0

    def _cpu_index() -> int:
        nonlocal calls
        calls += 1
        return 0

    accel.current_device_index = _cpu_index  # type: ignore[assignment]
    try:
        yield
    finally:
        accel.current_device_index = original  # type: ignore[assignment]
        if calls:
            rig_patches.record("cpu_accelerator_index", f"answered 0 {calls}x")
