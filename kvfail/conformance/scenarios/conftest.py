"""Loads the kvfail plugin for a run of the shipped scenarios where pytest did not load it
from its ``pytest11`` entry point (plugin autoload disabled)."""

from __future__ import annotations

from kvfail.conformance.plugin import fallback_plugins

pytest_plugins: list[str] = fallback_plugins()
