"""What the rig changes in the system under test, recorded where the change is made.

Why: a verdict on an upstream connector is only as good as the system it was reached on.
The rig runs vLLM's real code, but in a few places it changes what that code sees (a torch
call answered on CPU, NIXL's progress-thread delay). A report that does not say so lets a
reader take the verdict for one on an untouched system. So each patch site calls
:func:`record` when the change takes effect, and the conformance report and the audit
list what was recorded (``docs/rig-patches.md`` explains each patch).

Patches happen in several processes (the test process, D's TP rank processes, P
processes). A process that has ``$KVFAIL_RIG_PATCH_LOG`` set (the conformance plugin sets
it, and children inherit it) also appends each record as one JSON line to that file, so
the reporting process sees them all. Plain Python: no vLLM, torch or NIXL import.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "CATALOGUE",
    "LOG_ENV",
    "PEER_PROCESS_PREFIX",
    "Application",
    "RigPatch",
    "read_log",
    "record",
    "recorded",
    "summarize",
]

#: File every process appends its records to (one JSON object per line); unset: memory only.
LOG_ENV = "KVFAIL_RIG_PATCH_LOG"
#: Process labels of the rig's P processes (``python -m kvfail.peers.<module>``): a patch
#: made only there leaves the connector under test (D's) as it is.
PEER_PROCESS_PREFIX = "kvfail.peers."


@dataclass(frozen=True, slots=True)
class RigPatch:
    """One change the rig can make to the system under test, described for a report."""

    name: str
    #: The object changed, as a dotted path.
    target: str
    #: What it changes, in a sentence.
    change: str
    why: str
    #: Whether the connector under test can see the change (its own code or objects) when
    #: it is made in D's processes; made only in P processes, it touches the rig's peers.
    touches_connector: bool
    #: How to run without it, or why one cannot.
    without: str
    #: The module that records it (it calls :func:`record`).
    site: str


CATALOGUE: Mapping[str, RigPatch] = MappingProxyType(
    {
        p.name: p
        for p in (
            RigPatch(
                name="nixl_progress_delay",
                target="nixl._bindings.nixlAgent (via nixl._api.nixlBind)",
                change="an agent created with a polling progress thread (pthrDelay 0) gets a "
                "pause between polls instead ($KVFAIL_NIXL_PTHR_DELAY_US µs)",
                why="NIXL's busy poll takes a whole core per agent, idle or not; on a small CPU "
                "rig the engines then step late and deadline checks run late with them",
                touches_connector=True,
                without="set KVFAIL_NIXL_PTHR_DELAY_US=0: D's agents keep NIXL's busy poll "
                "(the rig's P processes keep the delay)",
                site="kvfail.rig.nixl_progress",
            ),
            RigPatch(
                name="mooncake_p_peer_caches",
                target="Mooncake TransferEngine configuration and writes of the rig's P processes",
                change="P's transfer engine keeps no cache of a D's segment metadata "
                "(MC_DISABLE_METACACHE=1) and keeps its pooled TCP connections "
                "(MC_TCP_ENABLE_CONNECTION_POOL=1); a write into D that fails is written "
                "once more, on a fresh connection",
                why="the suite builds a new D engine for every scenario in one process, and "
                "Mooncake gives each a random port out of about 2,000, so a long-lived P soon "
                "meets a new D at an address an ended one had; P's first write there goes to "
                "the ended D's metadata or connection and fails (-1), which would fail a good "
                "load and be charged to the D under test. The pool stays on because without it "
                "Mooncake starts each write on the calling thread, which races its transport "
                "thread on a timer and can wedge P's transfer engine for good",
                touches_connector=False,
                without="set MC_DISABLE_METACACHE=0 in the environment: the rig's P keeps "
                "Mooncake's metadata cache; the retry stays (without it a good load fails "
                "once a D address repeats)",
                site="kvfail.peers.producer",
            ),
            RigPatch(
                name="cpu_accelerator_index",
                target="torch.accelerator.current_device_index",
                change="answers 0 instead of raising, only while a connector is being "
                "constructed, only on a machine without an accelerator",
                why="upstream's Mooncake worker asks torch for the current accelerator in its "
                "constructor, which raises on CPU-only torch; the device it gets is passed only "
                "to current_platform.set_device, which does nothing on CPU",
                touches_connector=True,
                without="none on CPU-only torch: the connector cannot be constructed; on a "
                "machine with an accelerator the shim does nothing",
                site="kvfail.rig.cpu_shim",
            ),
            RigPatch(
                name="cpu_cuda_event",
                target="torch.cuda.Event",
                change="a no-op event (record, synchronize, query, wait do nothing) while a "
                "MooncakeStore P engine in the test process is built or steps, only on a "
                "machine without CUDA",
                why="MooncakeStoreConnector's save path records a torch.cuda.Event before "
                "handing blocks to its sending thread, which CPU-only torch cannot build; on "
                "CPU the KV tensors are written before the step returns, so there is nothing "
                "to wait for",
                touches_connector=False,
                without="none on CPU-only torch: P cannot save; D, a consumer, never records "
                "an event and never runs under the patch; with CUDA the patch does nothing",
                site="kvfail.conformance.mooncake_store_driver",
            ),
        )
    }
)


@dataclass(frozen=True, slots=True)
class Application:
    """One time a patch took effect in one process."""

    name: str
    pid: int
    #: What the process runs (``pytest``, ``kvfail.peers.nixl_producer``, ...).
    process: str
    detail: str = ""


_lock = threading.Lock()
_applied: list[Application] = []


def _process_label() -> str:
    """A short name for what this process runs, from its command line."""
    argv0 = sys.argv[0] if sys.argv else ""
    if not argv0:
        return "python"
    path = Path(argv0)
    if path.suffix == ".py" and "kvfail" in path.parts:  # ``python -m kvfail.x.y``
        parts = path.with_suffix("").parts
        return ".".join(parts[parts.index("kvfail") :])
    if path.name == "__main__.py":  # ``python -m pytest``
        return path.parent.name
    return path.name


def record(name: str, detail: str = "") -> None:
    """Note that patch ``name`` (a :data:`CATALOGUE` key) took effect in this process.

    Never raises for a log it cannot write: reporting a patch must not change the run."""
    if name not in CATALOGUE:
        raise KeyError(f"{name!r} is not a known rig patch: add it to kvfail.rig.patches")
    app = Application(name, os.getpid(), _process_label(), detail)
    line = json.dumps(asdict(app)) + "\n"
    with _lock:
        _applied.append(app)
        path = os.environ.get(LOG_ENV)
        if path:
            try:
                # One write per line, O_APPEND: lines from several processes never interleave.
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            except OSError:
                pass


def recorded() -> list[Application]:
    """What this process recorded, in order."""
    with _lock:
        return list(_applied)


def read_log(path: str | Path, offset: int = 0) -> tuple[list[Application], int]:
    """Records in the log from byte ``offset``, and the offset after the last whole line."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    apps = []
    for raw in data[:end].splitlines():
        try:
            fields = json.loads(raw)
            apps.append(Application(**fields))
        except (ValueError, TypeError):  # a line from another version: skip it
            continue
    return apps, offset + end


def summarize(apps: Iterable[Application]) -> list[dict[str, Any]]:
    """One entry per patch that took effect: its description, how often, in which
    processes; in catalogue order (a report lists them the same way every run).
    ``touches_connector`` is false when every application was in a P process."""
    by_name: dict[str, list[Application]] = {}
    for app in apps:
        by_name.setdefault(app.name, []).append(app)
    out = []
    for name, patch in CATALOGUE.items():
        seen = by_name.get(name)
        if not seen:
            continue
        in_d = [a for a in seen if not a.process.startswith(PEER_PROCESS_PREFIX)]
        out.append(
            {
                **asdict(patch),
                "touches_connector": patch.touches_connector and bool(in_d),
                "applied": len(seen),
                "processes": len({a.pid for a in seen}),
                "where": sorted({a.process for a in seen}),
                "details": sorted({a.detail for a in seen if a.detail})[:5],
            }
        )
    return out
