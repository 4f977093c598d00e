"""Loads the kvfail plugin for ``pytest conformance/`` where pytest did not load it from
its ``pytest11`` entry point, and enables ``pytester`` for ``selftest/``."""

from __future__ import annotations

import pytest

from kvfail.conformance.plugin import fallback_plugins

#: ``pytester`` runs the suite against the negative controls in ``selftest/``.
pytest_plugins: list[str] = ["pytester", *fallback_plugins()]


def pytest_report_header(config: pytest.Config) -> str:
    """Which Scheduler the run judges against: vLLM's as installed, or as if block-level
    reporting were removed (``KVFAIL_REPORTING=request-level``). Imported here, after the
    plugin's configure: the harness package imports vLLM."""
    from kvfail.harness.reporting import ENV, from_env

    mode = from_env()
    if mode == "request-level":
        return f"kvfail reporting: {mode} ({ENV}: block-level reporting removed, vLLM #42461)"
    return f"kvfail reporting: {mode} (vLLM's channels as installed; {ENV} switches it)"
