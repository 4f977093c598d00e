"""The one stand-in a real Mooncake worker connector needs to be built on CPU-only torch.

Why: upstream's ``MooncakeConnectorWorker.__init__`` calls
``torch.accelerator.current_device_index()``, which raises on CPU torch ("Cannot access
accelerator device when none is available"), while ``current_platform.set_device`` right
after it is a no-op on CPU. vLLM's files are not edited: :func:`cpu_accelerator_index_shim`
makes that one torch call return 0 *only while a connector is being constructed*, and
restores it on exit. On a machine with an accelerator it does nothing.

It lives here, beside the contract, because kvfail's own Mooncake connector is built in it
(a production connector imports nothing from the rig). The rig, which also builds upstream's
connector in it, records each block in which the stand-in answered as a rig patch: it
registers a listener with :func:`on_stand_in` (:mod:`kvfail.rig.cpu_shim`). Importing this
module imports no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["cpu_accelerator_index_shim", "on_stand_in"]

#: Called with the number of times the stand-in answered, at the end of each block in
#: which it answered at least once.
_listeners: list[Callable[[int], None]] = []


def on_stand_in(listener: Callable[[int], None]) -> None:
    """Call ``listener(calls)`` after each block in which the stand-in answered."""
    if listener not in _listeners:
        _listeners.append(listener)


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
            for listener in list(_listeners):
                listener(calls)
