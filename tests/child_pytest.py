"""A pytest run in a child process, with this checkout first on its path.

Why: some behaviour can only be seen from outside a session (its exit status, the files it
leaves when it is interrupted or crashes), so the test runs a real ``python -m pytest``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_child_pytest(
    args: list[str],
    cwd: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> tuple[int, str]:
    """Run ``pytest args`` in ``cwd`` (bounded), with ``env`` added to the environment;
    returns its exit status and its output. ``prefix``: a command that execs the rest
    (e.g. one that gives the child a namespace of its own)."""
    done = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr
