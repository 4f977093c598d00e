"""The conformance README shows the project's own default run; it must show the real one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_default_run_is_the_one_pyproject_sets() -> None:
    """A connector author copies this block; a stale copy would promise a matrix the
    project no longer runs (the default layouts once drifted from ``pyproject.toml``)."""
    readme = (ROOT / "conformance" / "README.md").read_text()
    blocks = re.findall(r"```toml\n(\[tool\.pytest\.ini_options\]\n.*?)```", readme, re.S)
    assert len(blocks) == 1, "expected one [tool.pytest.ini_options] block in the README"
    shown = tomllib.loads(blocks[0])["tool"]["pytest"]["ini_options"]
    real = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert shown, "the README's block sets nothing"
    for key, value in shown.items():
        got = real.get(key)
        assert got == value, f"README shows {key} = {value!r}, pyproject sets {got!r}"
