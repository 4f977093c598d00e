"""The README stays a guide: short, its two commands first, no dated runs or figures.

Why: it once grew into a diary of dated runs and hand-typed timings, with the layout map at
its end. Figures now live in ``docs/measurements.md``, rendered from the benches' records by
``python -m bench.report``; CI runs exactly the README's test command (``.ci/run`` calls
``scripts/test.sh``), so the README must name that command.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
COMMANDS = (
    "./scripts/setup.sh && .venv/bin/kvfail audit --fail-on never",
    "./scripts/setup.sh && ./scripts/test.sh",
)
SECTIONS = (
    "The problem",
    "What you get",
    "Adopting the mixin",
    "Running the suite on your connector",
    "Guard any connector",
    "Layout",
)
#: A date, or a number with a unit of time or of a measured quantity.
FIGURE = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\b\d[\d,.]*\s?(?:s|ms|µs|us|ns|min|minutes?|seconds?|%|x|GiB|MiB|KiB)\b"
)


def _text() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(_text().splitlines()) <= 200


def test_the_two_commands_come_first() -> None:
    first_block = re.search(r"```bash\n(.*?)```", _text(), re.S)
    assert first_block and first_block.start() < _text().index("\n## ")
    lines = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines()]
    assert lines == list(COMMANDS)


def test_ci_runs_the_readmes_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "./scripts/test.sh" in ci or "scripts/test.sh" in ci
    assert "scripts/test.sh" in COMMANDS[1]


def test_the_guide_has_its_sections_in_order() -> None:
    heads = re.findall(r"^## (.+)$", _text(), re.M)
    positions = [heads.index(s) for s in SECTIONS]
    assert positions == sorted(positions), heads


def test_no_dates_or_measured_figures() -> None:
    prose = re.sub(r"```.*?```", "", _text(), flags=re.S)  # code keeps its own numbers
    found = FIGURE.findall(prose)
    assert not found, f"README carries dates or figures (they go to docs/measurements.md): {found}"


@pytest.mark.parametrize("target", sorted(set(re.findall(r"\]\(([^)#]+)\)", README.read_text()))))
def test_every_link_resolves_in_the_repository(target: str) -> None:
    if target == "docs/guard.md" and not (ROOT / target).exists():
        pytest.skip("docs/guard.md arrives with the guard connector")
    assert (ROOT / target).exists(), target


def test_the_readme_shows_the_version_heat_map() -> None:
    # The picture `kvfail matrix --heatmap` generates, drawn in the guide, not only linked.
    assert "![" in _text() and "](docs/vllm-versions.png)" in _text()
    assert (ROOT / "docs" / "vllm-versions.png").exists()
