"""Child processes for tests: any command, bounded, with its output captured; and a pytest
run with this checkout first on its path.

Why: some behaviour can only be seen from outside a session (its exit status, the files it
leaves when it is interrupted or crashes, an interpreter started with other flags), so the
test runs a real child and judges its exit status and output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_child(
    cmd: Sequence[str],
    *,
    cwd: Path | None = None,
    timeout_s: float,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in ``cwd``, killed after ``timeout_s``; its stdout and stderr captured as
    text. ``env``: the child's whole environment (None: this process's). ``check``: raise
    if it exits non-zero (for a step whose output the test does not judge)."""
    return subprocess.run(
        list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=check
    )


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
    done = run_child(
        [*(prefix or []), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        timeout_s=timeout_s,
        env={**child_env(), **(env or {})},
    )
    return done.returncode, done.stdout + done.stderr
