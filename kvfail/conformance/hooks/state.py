"""What one conformance session holds: its drivers, their capabilities, its records.

Why one object in the config's stash: every hook module reads the same session, and a
session nested in another (the self-test's ``pytester`` runs) has its own.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfail.conformance.baseline import Baseline
from kvfail.conformance.capabilities import Capabilities
from kvfail.conformance.hooks.coverage import Ledger
from kvfail.conformance.layout import Layout
from kvfail.conformance.report import Record
from kvfail.rig import patches as rig_patches


@dataclass
class SessionState:
    connectors: list[str]
    policies: list[str]
    layouts: list[Layout]
    report_dir: str | None
    silent_wait_s: float
    #: ``--kvfail-require-drivers``: a driver that cannot run here fails, never skips.
    require_drivers: bool = False
    baseline: Baseline | None = None
    write_baseline: str | None = None
    drivers: dict[str, Any] = field(default_factory=dict)
    #: Drivers that cannot run here (their transport is absent): spec -> why.
    unavailable: dict[str, str] = field(default_factory=dict)
    #: Drivers that should run but broke (start or capabilities raised): spec -> why.
    broken: dict[str, str] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    caps: dict[str, Capabilities] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    session_start: float = field(default_factory=time.monotonic)
    #: The rig-patch log every process of this run appends to (see ``PatchLog``).
    patches: PatchLog | None = None
    #: Layouts limited to some policies (``tp2-g2:recompute``), with those policies.
    layout_policies: dict[Layout, frozenset[str]] = field(default_factory=dict)
    #: Position of each connector's last scenario, and of every item, in the run's order.
    last_index: dict[str, int] = field(default_factory=dict)
    item_index: dict[str, int] = field(default_factory=dict)
    #: Whether this run froze the collector's heap (a run with scenarios; see
    #: ``pytest_collection_finish``).
    froze: bool = False
    #: ``--kvfail-seed``: the soak's seed (None: the suite's fixed one).
    seed: int | None = None
    #: ``--kvfail-soak-batches``: the soak's length (None: the suite's full soak).
    soak_batches: int | None = None
    #: The clauses each connector got a verdict on (the coverage gate).
    coverage: Ledger = field(default_factory=Ledger)
    #: What the gate found unjudged at the end (set at session finish).
    unverified: list[str] = field(default_factory=list)
    #: The report files have their final form (see ``hooks.reporting``).
    report_final: bool = False

    def resolve(self, spec: str) -> Any:
        """The driver for ``spec``, resolved once (not started). Raises
        :class:`pytest.UsageError` when ``spec`` names no connector: a typo must stop the
        run, not turn into a row of skips."""
        if spec in self.drivers:
            return self.drivers[spec]
        from kvfail.conformance.driver import DriverUnavailable
        from kvfail.conformance.resolve import resolve

        try:
            driver = resolve(spec)
        except DriverUnavailable as exc:
            raise pytest.UsageError(f"--connector {spec}: {exc}") from None
        except Exception as exc:
            raise pytest.UsageError(
                f"--connector {spec}: cannot be resolved ({type(exc).__name__}: {exc})"
            ) from None
        self.drivers[spec] = driver
        return driver

    def driver(self, spec: str) -> Any:
        """The started driver; None (with ``unavailable`` or ``broken`` set) if it cannot run.

        Why two outcomes: a transport that is not installed here is a fact about this
        machine (a named skip, or a failure under ``--kvfail-require-drivers``); a driver
        whose start raises is a broken rig or a crashing peer, which must never look like
        a skip."""
        if spec in self.unavailable or spec in self.broken:
            return None
        driver = self.resolve(spec)
        if spec in self.caps:
            return driver
        why = driver.unavailable()
        if why is not None:
            self.unavailable[spec] = why
            return None
        # Marked started first: a start that raises half-way still gets its stop (which is
        # idempotent), so no peer it spawned outlives the session.
        self.started.add(spec)
        try:
            driver.start()
            self.caps[spec] = driver.capabilities()
        except Exception as exc:
            self.broken[spec] = f"{spec}: driver failed to start ({type(exc).__name__}: {exc})"
            return None
        # A started driver has imported what its engines need (vLLM imports much of itself
        # lazily, at the first engine) and holds peers for the session: freeze them with
        # the rest (see pytest_collection_finish).
        gc.freeze()
        return driver


class PatchLog:
    """This run's rig-patch records (:mod:`kvfail.rig.patches`), from every process.

    Why a file: patches take effect in D's TP rank processes and in P processes too; the
    path goes to them through ``$KVFAIL_RIG_PATCH_LOG``, which children inherit. Records
    are read as each scenario ends and credited to that scenario's connector: a patch is
    process-wide or made while that connector's engines were built, so a connector's
    records list what it ran under so far."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvfail-rig-patches-", suffix=".jsonl")
        os.close(fd)
        self.previous = os.environ.get(rig_patches.LOG_ENV)
        os.environ[rig_patches.LOG_ENV] = self.path
        self.offset = 0
        self.applied: list[rig_patches.Application] = []
        self.by_connector: dict[str, set[str]] = {}
        #: Records read here and not yet passed on (a distributed run's worker sends them).
        self.unsent: list[rig_patches.Application] = []

    def _read(self) -> list[rig_patches.Application]:
        new, self.offset = rig_patches.read_log(self.path, self.offset)
        self.applied += new
        self.unsent += new
        return new

    def credit(self, connector: str) -> list[str]:
        """Read what was recorded since the last call; the patches ``connector`` ran under."""
        self.merge(self._read(), connector, applied=False)
        return [n for n in rig_patches.CATALOGUE if n in self.by_connector[connector]]

    def merge(
        self,
        apps: list[rig_patches.Application],
        connector: str | None,
        *,
        applied: bool = True,
    ) -> None:
        """Count ``apps`` (read elsewhere: a worker's; ``applied=False`` when already
        counted) and credit them to ``connector`` when given."""
        if applied:
            self.applied += apps
        if connector is not None:
            self.by_connector.setdefault(connector, set()).update(a.name for a in apps)

    def take_unsent(self) -> list[rig_patches.Application]:
        """What was read and not yet passed on, after reading what is left; cleared."""
        self._read()
        out, self.unsent = self.unsent, []
        return out

    def summary(self, *, read: bool = True) -> list[dict[str, Any]]:
        """Every patch applied so far; ``read=False`` leaves records not yet read for the
        next :meth:`credit` (a report written mid-run must not take them from it)."""
        if read:
            self._read()
        out = rig_patches.summarize(self.applied)
        for entry in out:
            entry["connectors"] = sorted(
                c for c, names in self.by_connector.items() if entry["name"] in names
            )
        return out

    def close(self) -> None:
        if os.environ.get(rig_patches.LOG_ENV) == self.path:
            if self.previous is None:
                os.environ.pop(rig_patches.LOG_ENV, None)
            else:
                os.environ[rig_patches.LOG_ENV] = self.previous
        with contextlib.suppress(OSError):
            os.unlink(self.path)


STATE = pytest.StashKey[SessionState]()
#: Each phase's report of a scenario, in order.
PHASES = pytest.StashKey[list[tuple[str, pytest.TestReport]]]()
#: The first failure message of a scenario.
FAILURE = pytest.StashKey[str]()
#: The :class:`MissingFeatureError` message a scenario ended in (its record is an error).
MISSING = pytest.StashKey[str]()
#: The oracles' findings of a scenario that failed on them (not on an error).
VIOLATIONS = pytest.StashKey[list[str]]()
#: What a suite skip named as missing (``SuiteSkip.needs``).
SKIP_NEEDS = pytest.StashKey[tuple[str, ...]]()


def is_suite_item(item: pytest.Item) -> bool:
    """A conformance scenario (it takes the ``scenario`` fixture, or its deprecated alias
    ``kvfail``); other tests are left alone. ``scenario`` alone is a common name, so a test
    counts only when the suite's ``kvfail_connector`` parameter comes with it."""
    names = getattr(item, "fixturenames", ())
    return "kvfail" in names or ("scenario" in names and "kvfail_connector" in names)


def item_key(item: pytest.Item) -> tuple[str, str, str, str] | None:
    """(connector spec, scenario, policy, layout) of a parametrised scenario."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "kvfail_connector" not in callspec.params:
        return None
    return (
        str(callspec.params["kvfail_connector"]),
        getattr(item, "originalname", item.name),
        str(callspec.params["kvfail_policy"]),
        callspec.params["kvfail_layout"].name,
    )
