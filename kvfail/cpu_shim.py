"""The one shim a real Mooncake worker connector needs on CPU-only torch.

Why: upstream's ``MooncakeConnectorWorker.__init__`` calls
``torch.accelerator.current_device_index()``, which raises on CPU torch ("Cannot access
accelerator device when none is available"),
while ``current_platform.set_device`` right after it is a no-op on CPU. We do not patch
vLLM's files: this context manager makes that one torch call return 0 *only while a
connector is being constructed*, and restores it on exit. On a machine with an accelerator
it does nothing. Used by ``connectors.mooncake`` and by the peers that run upstream's
connector; importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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

    def _cpu_index() -> int:
        return 0

    accel.current_device_index = _cpu_index  # type: ignore[assignment]
    try:
        yield
    finally:
        accel.current_device_index = original  # type: ignore[assignment]
