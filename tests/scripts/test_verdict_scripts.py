"""The scripts that compare two runs' verdicts read pytest's own junit XML: written here by
a real child pytest, so a change in how pytest records an xfail or a setup error shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from junit_verdicts import Verdict, verdicts  # noqa: E402
from verdict_diff import report  # noqa: E402

# One scenario's outcomes at two commits, as a connector author's run would give them.
BEFORE = {"stays": "pass", "turns_red": "pass", "reworded": "C9 leak", "gone": "pass"}
AFTER = {"stays": "pass", "turns_red": "C1 wrong KV", "reworded": "C2/C10 liveness", "new": "xf"}


def _run(tmp_path: Path, name: str, plan: dict[str, str]) -> Path:
    body = ["import pytest", ""]
    for test, outcome in plan.items():
        body.append(f"@pytest.mark.parametrize('policy', ['fail'])\ndef test_{test}(policy):")
        if outcome == "pass":
            body.append("    pass")
        elif outcome == "xf":
            body.append("    pytest.xfail('known')")
        else:
            body.append(f"    raise AssertionError('{outcome}: something went wrong')")
    module = tmp_path / f"test_{name}.py"
    module.write_text("\n".join(body) + "\n")
    xml = tmp_path / f"{name}.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(module),
            f"--junitxml={xml}",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    return xml


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("verdicts")
    return _run(tmp, "before", BEFORE), _run(tmp, "after", AFTER)


def test_verdicts_read_outcome_and_finding_kinds(runs: tuple[Path, Path]) -> None:
    after = verdicts(runs[1])
    assert after["test_stays[fail]"] == Verdict("passed")
    assert after["test_turns_red[fail]"] == Verdict("failed", ("C1 wrong KV",))
    assert after["test_new[fail]"] == Verdict("xfailed")


def test_diff_names_each_change_and_fails_on_an_outcome_change(runs: tuple[Path, Path]) -> None:
    lines, changed = report(*runs, labels=("before", "after"))
    text = "\n".join(lines)
    assert changed == 1
    assert "| `test_turns_red[fail]` | passed | failed (C1 wrong KV) |" in text
    assert "| `test_reworded[fail]` | failed (C9 leak) | failed (C2/C10 liveness) |" in text
    assert "### Only in before (1)" in text and "`test_gone[fail]`" in text
    assert "### Only in after (1)" in text and "`test_new[fail]` | xfailed" in text
    rc = subprocess.run(
        [sys.executable, str(SCRIPTS / "verdict_diff.py"), *map(str, runs)],
        capture_output=True,
        timeout=60,
        check=False,
    ).returncode
    assert rc == 1


def test_an_xdist_group_suffix_names_the_same_test() -> None:
    """A run with ``-n --dist loadgroup`` names grouped tests ``name@group``; the diff
    must match them with a serial run's names, or every test is 'only in one run'."""
    from junit_verdicts import xdist_free

    assert xdist_free("test_x[mooncake-fail]@kvfail-mooncake") == "test_x[mooncake-fail]"
    assert xdist_free("test_y@simulated-hosts") == "test_y"
    assert xdist_free("test_x[a@b]") == "test_x[a@b]"
    assert xdist_free("test_x[mooncake-fail]") == "test_x[mooncake-fail]"
