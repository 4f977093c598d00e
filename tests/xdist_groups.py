"""One xdist group per module-scoped run, so that an expensive module fixture runs once.

Why: many modules here start real peers or a whole inner session in a module-scoped
fixture, and ``--dist loadgroup`` hands ungrouped tests out one by one, so two workers
each ran the same fixture (seen in CI: the same minute-long inner session set up on
both workers). Tests of one module that use different module fixtures still spread.
Inert without xdist.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["group_module_runs"]


def group_module_runs(items: list[pytest.Item], under: Path) -> None:
    """Mark each test below ``under`` that uses module-scoped fixtures of its own module
    with a group named after them. A test already in a group keeps it (a module may need
    one worker for another reason, e.g. the simulated hosts)."""
    for item in items:
        module = getattr(item, "module", None)
        info = getattr(item, "_fixtureinfo", None)
        if module is None or info is None or under not in item.path.parents:
            continue
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = sorted(
            name
            for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope == "module" and defs[-1].func.__module__ == module.__name__
        )
        if shared:
            group = f"{item.path.relative_to(under.parent)}:{'+'.join(shared)}"
            item.add_marker(pytest.mark.xdist_group(group))
