"""The coverage gate: every connector vLLM registers gets a verdict, or says why not.

A registered connector is covered when one of these holds:

* a transport driver runs it (``kvfail audit``'s dynamic tier gives it verdicts);
* its source shows it never loads external KV (not applicable);
* its source shows it cannot run here (blocked, with the exact reason);
* it is listed in :data:`DRIVERS_PENDING`: runnable here, its driver not built yet. An
  entry there is checked too: once a driver exists, or its source gains a never-loads or
  blocking reason, the entry is stale and the gate names it.

Everything is read from source (the installed ``factory.py``, the connector modules, the
``kvfail.drivers`` entry points' names), so the gate imports neither vLLM nor a driver
and runs in the default test run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

from kvfail.audit.applicability import Applicability, Assessor
from kvfail.audit.callgraph import Graph
from kvfail.audit.inventory import registry_entries
from kvfail.audit.source import ClassRef, SourceIndex

#: The ``--connector`` values of upstream classes with a built-in transport driver
#: (registered in ``kvfail.drivers``); a registry class that is, or derives from,
#: one of them gets that driver (``_driver_for_class``). Kept as source locations so the
#: gate needs no vLLM import; tests/audit checks them against the driver module.
DRIVEN_CLASSES: dict[str, str] = {
    "vllm:MooncakeConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector:MooncakeConnector"
    ),
    "vllm:NixlConnector": "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector",
}
#: Registry connectors that run here and have no driver yet, and why they are not blocked.
DRIVERS_PENDING: dict[str, str] = {}
ENTRY_POINT_GROUP = "kvfail.drivers"


@dataclass
class Verdict:
    """One registry connector's coverage: ``kind`` and the words (and lines) for it."""

    name: str
    kind: str  # driver | not_applicable | blocked | pending | uncovered | stale
    reason: str
    applicability: Applicability | None = None


def driver_entry_points() -> set[str]:
    """Names in the ``kvfail.drivers`` group (nothing is loaded)."""
    try:
        return {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    except Exception:  # a broken distribution must not hide the others
        return set()


def driven_refs(index: SourceIndex) -> dict[str, ClassRef]:
    out: dict[str, ClassRef] = {}
    for spec, path in DRIVEN_CLASSES.items():
        module, _, cls = path.partition(":")
        ref = index.resolve_class(module, cls)
        if ref is not None:
            out[spec] = ref
    return out


def driver_for(
    name: str, ref: ClassRef | None, graph: Graph, driven: dict[str, ClassRef], eps: set[str]
) -> str | None:
    """The ``--connector`` value whose driver runs registry connector ``name``, or None."""
    spec = f"vllm:{name}"
    if spec in eps:
        return spec
    if ref is None:
        return None
    mro = graph.model(ref).mro
    for driver_spec, base in driven.items():
        if any(r.node is base.node for r in mro):
            return driver_spec
    return None


def check_registry(
    entries: Iterable[tuple[str, str, str]] | None = None,
    *,
    pending: dict[str, str] | None = None,
    entry_points: set[str] | None = None,
    index: SourceIndex | None = None,
) -> list[Verdict]:
    """A verdict for each ``(name, module, class)`` (default: the installed registry)."""
    index = index or SourceIndex()
    graph = Graph(index)
    assess = Assessor(index, graph)
    driven = driven_refs(index)
    eps = driver_entry_points() if entry_points is None else entry_points
    pending = DRIVERS_PENDING if pending is None else pending
    if entries is None:
        entries = [(n, m, c) for n, m, c, _p, _l in registry_entries()]
    out: list[Verdict] = []
    for name, module, cls in entries:
        ref = index.resolve_class(module, cls)
        if ref is None:
            out.append(Verdict(name, "uncovered", f"{module}:{cls} cannot be read from source"))
            continue
        driver = driver_for(name, ref, graph, driven, eps)
        # A driven row needs no reason (and the walk of a large connector costs seconds).
        found = assess(ref) if driver is None or name in pending else None
        if driver is not None and name not in pending:
            out.append(Verdict(name, "driver", f"driver {driver}", found))
        elif found is not None and name not in pending:
            out.append(Verdict(name, found.kind, found.reason, found))
        elif name in pending:
            why = f"driver {driver} exists" if driver else (found.reason if found else "")
            if why:
                out.append(Verdict(name, "stale", f"listed as pending but {why}", found))
            else:
                out.append(Verdict(name, "pending", pending[name]))
        else:
            out.append(
                Verdict(
                    name,
                    "uncovered",
                    "no transport driver, no never-loads finding and no blocking reason",
                )
            )
    return out


def gate_failures(verdicts: list[Verdict]) -> list[str]:
    """One line per connector the gate rejects (empty: every connector is covered)."""
    return [f"{v.name}: {v.kind}: {v.reason}" for v in verdicts if v.kind in ("uncovered", "stale")]
