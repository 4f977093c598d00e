"""A process that ends itself with ``os._exit`` (one holding NIXL agents) passes on
pytest's real status: a failing run must never exit 0.

The guard once found the running session by scanning the heap, which misses everything
``gc.freeze`` froze; after the suite began freezing the heap at collection, a failing
NIXL run exited 0. Each case runs a real ``python -m pytest`` in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

#: The child's test: freeze the heap as the suite does after collection, then install the
#: guard the way a driver does, with no config in hand.
CHILD = """
import gc

import pytest

from kvfail.peers.nixl_exit_guard import install_exit_guard


def test_child():
    gc.freeze()
    install_exit_guard()
{body}
"""


def _run_child(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    indented = textwrap.indent(textwrap.dedent(body).strip(), "    ")
    (tmp_path / "test_child.py").write_text(CHILD.format(body=indented))
    (tmp_path / "test_inner.py").write_text("def test_inner():\n    assert False\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_child.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_failing_run_exits_with_failure(tmp_path: Path) -> None:
    done = _run_child(tmp_path, "assert False, 'the failure the exit status must carry'")
    assert "1 failed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr


def test_a_passing_run_exits_zero(tmp_path: Path) -> None:
    done = _run_child(tmp_path, "assert True")
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr


def test_the_outermost_session_decides(tmp_path: Path) -> None:
    """A nested session that fails (a self-test's inner run) does not fail its host."""
    done = _run_child(
        tmp_path,
        """
        assert pytest.main(["-q", "-p", "no:cacheprovider", "test_inner.py"]) == 1
        """,
    )
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
