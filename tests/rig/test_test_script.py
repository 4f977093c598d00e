"""``scripts/test.sh`` (what CI runs) fails a run whose pytest says 0 but whose report lists
failures, and a run that collected nothing.

The pytest sessions here are a stand-in interpreter (``PYTEST_PY``) that writes a JUnit
report and exits with a chosen status: the script's own logic is what is under test.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then
  for arg in "$@"; do
    case "$arg" in --junitxml=*) report="${{arg#--junitxml=}}" ;; esac
  done
  echo "$*" >> "$FAKE_ARGS"
  printf '<testsuites><testsuite failures="%s" errors="0" tests="3"/></testsuites>' \\
    "$FAKE_FAILURES" > "$report"
  exit "$FAKE_RC"
fi
exec {python} "$@"
"""


def _run(tmp_path: Path, *, rc: int, failures: int) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {
        **os.environ,
        "PYTEST_PY": str(fake),
        "FAKE_RC": str(rc),
        "FAKE_FAILURES": str(failures),
        "TMPDIR": str(tmp_path),
        "FAKE_ARGS": str(tmp_path / "args"),
    }
    env.pop("KVFAIL_WORKERS", None)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_clean_run_passes(tmp_path: Path) -> None:
    done = _run(tmp_path, rc=0, failures=0)
    assert done.returncode == 0, done.stderr
    # The default session on one xdist worker more than the cores (at most 4), a
    # connector's scenarios kept together; the e2e tier after it, in one process.
    default, e2e = (tmp_path / "args").read_text().splitlines()
    from kvfail.audit.dynamic_child import workers

    n = workers()
    if n:
        assert f"-n {n} --dist loadgroup" in default
    else:  # a machine the rule runs serially (one core, or no xdist)
        assert "-n" not in default.split()
    assert e2e.endswith("e2e -m e2e") and "-n" not in e2e.split()


def test_an_exit_0_with_failures_in_the_report_fails(tmp_path: Path) -> None:
    done = _run(tmp_path, rc=0, failures=2)
    assert done.returncode == 1
    assert "exited 0, but its report lists 2 failures or errors" in done.stderr


@pytest.mark.parametrize(("rc", "why"), [(1, None), (5, "collected no tests")])
def test_a_failing_or_empty_session_fails(tmp_path: Path, rc: int, why: str | None) -> None:
    done = _run(tmp_path, rc=rc, failures=0)
    assert done.returncode == 1
    if why is not None:
        assert why in done.stderr
