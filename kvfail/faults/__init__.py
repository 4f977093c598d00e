"""Real fault injection between a decode process D and a prefill peer P, on loopback only.

`FaultProxy` breaks the wire, `PeerProcess` breaks the peer, and `FaultPoint` names each
fault with the contract clauses it tests. Nothing here imports vLLM, so the fault tools can
be tested, and used by peers, without it.
"""

from kvfail.faults._net import LOOPBACK
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
from kvfail.faults.process import (
    STACK_SIGNAL,
    PeerExitedError,
    PeerProcess,
    busiest_processes,
    busy_threads,
    close_all,
    free_port,
    free_ports,
    install_stack_dump,
    live_peers,
    native_stacks,
    proc_state,
    spinning_threads,
    summarize_stacks,
    wait_for_port,
)
from kvfail.faults.proxy import FaultProxy, ProxyMode, ProxyStats

__all__ = [
    "CLAUSE_TITLES",
    "FAULT_SPECS",
    "LOOPBACK",
    "STACK_SIGNAL",
    "Clause",
    "Detection",
    "FaultPoint",
    "FaultProxy",
    "FaultSpec",
    "Injection",
    "PeerExitedError",
    "PeerProcess",
    "ProxyMode",
    "ProxyStats",
    "busiest_processes",
    "busy_threads",
    "close_all",
    "free_port",
    "free_ports",
    "install_stack_dump",
    "live_peers",
    "native_stacks",
    "points_for",
    "proc_state",
    "spinning_threads",
    "summarize_stacks",
    "wait_for_port",
]
