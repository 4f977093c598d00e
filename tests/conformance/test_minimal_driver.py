"""The driver guide's example driver runs the suite through the third party's own path.

Why a subprocess with a made-up distribution: a connector author's driver reaches the
suite only through an entry point in the ``kvfail.drivers`` group of their installed
package. So the test builds exactly that (a ``*.dist-info`` folder naming
``minimal_driver:make_driver``, next to a copy of the module, on ``PYTHONPATH``) and runs
the shipped scenarios with ``--connector minimal`` from a folder outside the checkout,
with ``--kvfail-require-drivers`` so a driver that cannot be found fails instead of
skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.child_pytest import run_child
from tests.conformance import minimal_driver

HERE = Path(__file__).resolve().parent
#: Scenarios that use every part of the example: a good load, an error answer, a silent
#: P ended by the deadline, an abort, a request with no load, and a slow P (net_delay).
EXPECTED_PASSED = (
    "test_local_request_untouched",
    "test_successful_load",
    "test_failed_load_one_group",
    "test_frozen_peer_caught_by_deadline",
    "test_abort_while_waiting",
    "test_slow_peer_not_failed_before_deadline",
)


def test_the_example_implements_the_whole_api() -> None:
    driver = minimal_driver.make_driver("minimal")
    caps = driver.capabilities()
    assert caps.remote_prefill and caps.async_load
    assert driver.unavailable() is None


def _third_party_install(root: Path) -> Path:
    """A folder that, on ``PYTHONPATH``, is an installed package registering the driver."""
    site = root / "site"
    dist = site / "minimal_kvfail_driver-0.1.dist-info"
    dist.mkdir(parents=True)
    shutil.copy2(HERE / "minimal_driver.py", site / "minimal_driver.py")
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: minimal-kvfail-driver\nVersion: 0.1\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(
        "[kvfail.drivers]\nminimal = minimal_driver:make_driver\n", encoding="utf-8"
    )
    return site


def test_the_example_runs_the_suite_as_a_registered_driver(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the suite needs vLLM")
    site = _third_party_install(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # The kvfail under test stays importable (a checkout run with PYTHONPATH set).
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    selected = " or ".join(EXPECTED_PASSED)
    run = run_child(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rs"),
            *("--pyargs", "kvfail.conformance.scenarios.test_scenarios"),
            "kvfail.conformance.scenarios.test_concurrency",
            *("--connector", "minimal", "--policy", "fail", "--layout", "tp1"),
            *("--kvfail-require-drivers", "-k", selected),
        ],
        cwd=work,
        timeout_s=600,
        env=env,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    passed = set(re.findall(r"::(test_\w+)\[[^\]]*\] PASSED", out))
    assert set(EXPECTED_PASSED) <= passed, out[-4000:]
