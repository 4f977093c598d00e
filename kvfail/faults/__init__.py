"""Real fault injection between a decode process D and a prefill peer P, on loopback only.

`FaultProxy` breaks the wire and `FaultPoint` names each fault with the contract clauses
it tests; the peer processes a fault kills or freezes, their ports and what ``/proc``
shows of them live in the rig (:mod:`kvfail.rig.processes`, :mod:`kvfail.rig.ports`,
:mod:`kvfail.rig.procfs`, :mod:`kvfail.rig.stacks`). Nothing here imports vLLM, so the
fault tools can be tested, and used by peers, without it.
"""

from kvfail.faults.points import (
    CLAUSE_TITLES,
    FAULT_SPECS,
    Clause,
    Detection,
    FaultPoint,
    FaultSpec,
    Injection,
    points_for,
)
from kvfail.faults.proxy import FaultProxy, ProxyMode, ProxyStats

__all__ = [
    "CLAUSE_TITLES",
    "FAULT_SPECS",
    "Clause",
    "Detection",
    "FaultPoint",
    "FaultProxy",
    "FaultSpec",
    "Injection",
    "ProxyMode",
    "ProxyStats",
    "points_for",
]
