"""Loads the kvfail conformance plugin for ``pytest conformance/``, unless it is already
registered as the ``pytest11`` entry point ``kvfail`` (pytest would refuse to register the
same module twice under two names). Also enables ``pytester`` for ``selftest/``."""

from __future__ import annotations

import importlib.metadata
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Mooncake logs INFO at interpreter exit, after pytest's summary line; keep that line last.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

_PLUGIN = "kvfail.conformance.plugin"


def _registered_as_entry_point() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == _PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))


#: ``pytester`` runs the suite against the negative controls in ``selftest/``.
pytest_plugins: list[str] = ["pytester"] + ([] if _registered_as_entry_point() else [_PLUGIN])
