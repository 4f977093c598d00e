"""``kvfail audit``: a per-connector compliance matrix for vLLM's load-error contract.

The static tier reads each connector's installed source (AST only, nothing is imported), so
it can audit connectors whose optional packages (lmcache, flexkv, ...) are missing. Every
cell comes from a check that ran against that source; no cell comes from a table.
The dynamic tier (conformance scenarios) plugs in through ``kvfail.audit.cli.run``'s
``dynamic_runner`` hook.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvfail.audit.inventory import Target, discover
from kvfail.audit.static import CHECKS, Finding, audit_target

__all__ = ["CHECKS", "Finding", "Target", "add_command", "audit_target", "discover"]


def add_command(
    subparsers: Any, name: str, doc: str | None, summary: str
) -> argparse.ArgumentParser:
    """Register the ``kvfail`` subcommand ``name`` (``audit``, ``matrix``): its ``--help``
    shows ``doc``, its module's docstring, with the line breaks it was written with."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser
