"""pytest plugin: ``pytest conformance/ --connector X [--policy P] [--kvfail-report DIR]``.

Registered as the ``pytest11`` entry point ``kvfail`` (or loaded by
``conformance/conftest.py`` until then). This module only gathers the hooks; each job
has its own module under :mod:`kvfail.conformance.hooks`: the options, the session's
life (parametrising, the fixture, stopping drivers), verdicts (only the suite skips, for
a capability it names; any other skip or xfail in a scenario fails it), the coverage gate
(a run fails when a clause got no verdict), baseline matching by fingerprint, the report
(written as the run goes, finished on any exit) and the shared-memory sweep. The clauses
each scenario cites are defined in ``docs/contract.md``.
"""

from __future__ import annotations

import os

from kvfail.conformance.hooks.lifecycle import (
    kvfail,
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_unconfigure,
    scenario,
)
from kvfail.conformance.hooks.lifecycle import release as _release
from kvfail.conformance.hooks.options import DEFAULT_CONNECTOR, drivers_required, pytest_addoption
from kvfail.conformance.hooks.reporting import pytest_terminal_summary
from kvfail.conformance.hooks.shm_sweep import _SHM_BEFORE
from kvfail.conformance.hooks.state import SessionState as _State
from kvfail.conformance.hooks.verdicts import HARNESS_ERROR, pytest_runtest_makereport
from kvfail.conformance.layout import POLICIES

__all__ = [
    "DEFAULT_CONNECTOR",
    "HARNESS_ERROR",
    "POLICIES",
    "_SHM_BEFORE",
    "_State",
    "_release",
    "drivers_required",
    "fallback_plugins",
    "kvfail",
    "pytest_addoption",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_makereport",
    "pytest_runtest_protocol",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_unconfigure",
    "scenario",
]


def fallback_plugins() -> list[str]:
    """What a conftest next to the scenarios lists in ``pytest_plugins``: this module, unless
    pytest already loaded it from the ``pytest11`` entry point ``kvfail`` (it refuses one
    module registered under two names)."""
    import importlib.metadata

    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        for ep in importlib.metadata.entry_points(group="pytest11"):
            if ep.value == __name__:
                return []
    return [__name__]
