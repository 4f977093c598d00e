"""Real fault injection between a decode process D and a prefill peer P, on loopback only.

`FaultProxy` breaks the wire and `FaultPoint` names each fault with the contract clauses
it tests; the peer processes a fault kills or freezes, their ports and what ``/proc``
shows of them live in the rig (:mod:`kvfail.rig.processes`, :mod:`kvfail.rig.ports`,
:mod:`kvfail.rig.procfs`, :mod:`kvfail.rig.stacks`). Nothing here imports vLLM, so the
fault tools can be tested, and used by peers, without it.
"""

from kvfail.faults import points
from kvfail.faults.points import *  # noqa: F403 - points.__all__ names what it exports, once
from kvfail.faults.proxy import FaultProxy, ProxyMode, ProxyStats

__all__ = ["FaultProxy", "ProxyMode", "ProxyStats"]
__all__ += points.__all__
