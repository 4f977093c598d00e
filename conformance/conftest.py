"""Loads the kvfail plugin for ``pytest conformance/`` where pytest did not load it from
its ``pytest11`` entry point, and enables ``pytester`` for ``selftest/``."""

from __future__ import annotations

from kvfail.conformance.plugin import fallback_plugins

#: ``pytester`` runs the suite against the negative controls in ``selftest/``.
pytest_plugins: list[str] = ["pytester", *fallback_plugins()]
