"""The wheel carries the suite, and the installed suite runs from outside the checkout.

A connector author installs kvfail next to their own vLLM and runs
``pytest --pyargs kvfail.conformance --connector X`` from their own folder. So: build the
wheel from this checkout, install it into a scratch venv that borrows only the third-party
packages of the running one (vLLM, torch, the transports, pytest; the editable kvfail of the
checkout is not visible there), and run five core scenarios for the toy and for kvfail's
Mooncake over its real transport, from a folder that is not the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.child_pytest import run_child

pytest.importorskip("vllm", reason="the installed suite needs vLLM")

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "kvfail/conformance/scenarios/__init__.py",
    "kvfail/conformance/scenarios/conftest.py",
    "kvfail/conformance/scenarios/test_scenarios.py",
    "kvfail/conformance/scenarios/test_concurrency.py",
    "kvfail/conformance/scenarios/test_concurrency_soak.py",
    "kvfail/conformance/scenarios/test_quarantine.py",
    "kvfail/conformance/plugin.py",
    "kvfail/conformance/many_loads.py",
    "connectors/mooncake/__init__.py",
}
PIP = (sys.executable, "-m", "pip")
#: The core scenarios' module; every scenario of every module runs in the default run.
SUITE = "kvfail.conformance.scenarios.test_scenarios"
#: What the installed copy must show it can do, one story each: a good load, a block-level
#: failure, a P killed (its restart), P's own error reply, and malformed params.
CORE = (
    "successful_load or failed_load_one_group or peer_killed_before_pull"
    " or peer_names_failed_request or params_missing_transfer_id"
)
#: The toy, and kvfail's Mooncake over its real transport; a driver that cannot start fails.
SUITE_ARGS = (
    *("-p", "no:cacheprovider", "-q", "--kvfail-report", "report", "--kvfail-require-drivers"),
    *("--connector", "toy", "--connector", "mooncake", "--policy", "fail", "--layout", "tp1"),
    *("-k", CORE),
)


def _source_copy(dest: Path) -> Path:
    """The checkout's files git knows (tracked, or new and not ignored), copied to ``dest``.

    Why build from a copy: setuptools writes ``kvfail.egg-info`` into the folder it builds
    from, and a stale one in the checkout shadows the editable install's metadata for
    every process started there, ``kvfail.drivers`` entry points included."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = _source_copy(tmp_path_factory.mktemp("source"))
    built = run_child(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        timeout_s=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("kvfail-*.whl")
    return path


def test_the_wheel_holds_the_scenarios(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert names >= SHIPPED, sorted(SHIPPED - names)
    assert not any(n.startswith(("tests/", "conformance/", "e2e/", "bench/")) for n in names)


@pytest.mark.timeout(1500)  # a whole suite run inside one test
def test_the_installed_suite_runs_from_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    installed = run_child(
        [*PIP, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        timeout_s=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    # The third-party packages come from the running venv as a plain path: its .pth files
    # (among them the hook that maps kvfail to the checkout) are not processed there.
    site = run_child(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        timeout_s=60,
        check=True,
    ).stdout.strip()
    Path(site, "borrowed-third-party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "KVFAIL_SHM_PREFIX"}}
    where = run_child(
        [
            str(python),
            "-c",
            "import kvfail, connectors; print(kvfail.__file__, connectors.__file__)",
        ],
        cwd=elsewhere,
        timeout_s=120,
        env=env,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    run = run_child(
        [str(python), "-m", "pytest", "--pyargs", SUITE, *SUITE_ARGS],
        cwd=elsewhere,
        timeout_s=1200,
        env=env,
    )
    failures = run.stdout.find("= FAILURES =")
    tail = run.stdout[failures : failures + 8000] if failures >= 0 else ""
    tail += run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
    # Each core story was selected for both connectors (the toy skips, by name, the faults
    # it cannot make): a renamed scenario must not shrink the check.
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped)", summary)}
    assert sum(counts.values()) == 2 * len(CORE.split(" or ")), summary
    assert (elsewhere / "report" / "report.json").is_file(), tail
