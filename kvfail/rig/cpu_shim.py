"""The CPU stand-in for one torch call (:mod:`kvfail.cpu`), recorded as a rig patch.

The stand-in changes what the system under test sees, so every block in which it answered
is recorded as the rig patch ``cpu_accelerator_index`` (:mod:`kvfail.rig.patches`); a
block in which no code asked (a NIXL connector built inside it) changed nothing and records
nothing. Importing this module registers the recorder, for the blocks kvfail's own
Mooncake connector opens too; the rig builds upstream's connectors (the harness's rank
processes, the peers, e2e) inside :func:`cpu_accelerator_index_shim` from here. Importing
it imports no torch.
"""

from __future__ import annotations

from kvfail.cpu import cpu_accelerator_index_shim, on_stand_in
from kvfail.rig import patches as rig_patches

__all__ = ["cpu_accelerator_index_shim"]


def _record(calls: int) -> None:
    rig_patches.record("cpu_accelerator_index", f"answered 0 {calls}x")


on_stand_in(_record)
