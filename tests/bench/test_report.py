"""``bench.report``: records in, ``docs/measurements.md`` out, and the page kept current.

Why: the page is the only place measured figures live. It must be exactly what the
committed records render (so nobody edits a figure by hand), and each figure must carry
its baseline and the circumstances of its run. The records here are fixtures; the one
bench run below is a scratch module that prints a known line, so no timing is asserted.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]

RECORD: dict[str, Any] = {
    "bench": "idle_step",
    "about": "Per-step cost of draining both failure channels when nothing failed.",
    "command": "python -m bench.idle_step",
    "exit_code": 0,
    "figures": {"idle_baseline_ns": "1500", "idle_kvfail_ns": "250", "idle_ratio": "6"},
    "targets": {"idle_ratio": ">= 3"},
    "baselines": {"idle_ratio": "idle_baseline_ns"},
    "output": ["queue.Queue baseline 1500", "kvfail drain 250"],
    "started_utc": "2000-01-01T00:00:00Z",
    "wall_s": 1.5,
    "cpu_s": 1.2,
    "load_avg_1min": {"start": 0.5, "max": 3.25, "end": 1.0},
    "machine": {"cpu_model": "Test CPU", "cores": 2, "memory_gib": 8.0, "python": "3.11.0"},
    "git": {"commit": "0123456789abcdef", "dirty": False},
    "vllm": "0.32.0",
}


def _detection() -> dict[str, Any]:
    rec = copy.deepcopy(RECORD)
    rec.update(
        bench="nixl_detection",
        command="python -m bench.nixl_detection --quick",
        figures={"refuse_upstream_s": "5.02", "refuse_kvfail_s": "0.015", "cap_s": "6"},
        targets={},
        output=[],
        git={"commit": None, "dirty": True},
    )
    del rec["baselines"]  # records saved before benches declared baselines still render
    return rec


def test_the_committed_page_is_what_the_committed_records_render() -> None:
    """The generated-file check: rerun ``python -m bench.report`` after any new record."""
    records = report.load(report.RESULTS)
    assert records, "bench/results/ holds no record: run python -m bench.report --run NAME"
    assert report.DOCUMENT.read_text(encoding="utf-8") == report.render(records), (
        "docs/measurements.md is stale: run python -m bench.report"
    )


def test_every_figure_appears_with_its_baseline_target_and_run() -> None:
    page = report.render([_detection(), RECORD])
    assert page.index("`bench.idle_step`") < page.index("`bench.nixl_detection`")  # by name
    assert "| `idle_kvfail_ns` | 250 | `idle_baseline_ns` = 1500 |  |" in page
    assert "| `idle_ratio` | 6 | `idle_baseline_ns` = 1500 | >= 3 |" in page  # declared
    assert "| `refuse_kvfail_s` | 0.015 | `refuse_upstream_s` = 5.02 |  |" in page
    assert "| `cap_s` | 6 |  |  |" in page
    runs = page.split("## Runs")[1].split("## Figures")[0]
    assert "`0123456789`" in runs  # the commit, shortened
    assert "`unknown (with local changes)`" in runs
    assert "0.5 / 3.25 / 1" in runs and "2 cores, Test CPU, 8 GiB" in runs
    assert "```text\nqueue.Queue baseline 1500\nkvfail drain 250\n```" in page


def test_the_page_is_a_function_of_the_records_alone(tmp_path: Path) -> None:
    """Saved and loaded back, in any order, the records render the same page."""
    for rec in (RECORD, _detection()):
        report.save(rec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idle_step.json", "nixl_detection.json"]
    assert report.render(report.load(tmp_path)) == report.render([RECORD, _detection()])
    out = tmp_path / "page.md"
    assert report.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text() == report.render([RECORD, _detection()])
    assert report.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("0.015", "0.010"))  # a hand edit
    assert report.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 1


def test_baselines_are_found_by_the_side_a_name_carries() -> None:
    figs = {
        "kill_warm_kvfail_s": "1",
        "kill_warm_upstream_s": "9",
        "idle_kvfail_ns": "2",
        "idle_baseline_ns": "8",
        "rig_failed_writes": "0",
        "default_failed_writes": "8",
        "delayed_cpu_per_s": "0.02",
        "spin_cpu_per_s": "1",
        "lonely_kvfail_s": "1",
    }
    assert report.baseline_of("kill_warm_kvfail_s", figs) == "kill_warm_upstream_s"
    assert report.baseline_of("idle_kvfail_ns", figs) == "idle_baseline_ns"
    assert report.baseline_of("rig_failed_writes", figs) == "default_failed_writes"
    assert report.baseline_of("delayed_cpu_per_s", figs) == "spin_cpu_per_s"
    assert report.baseline_of("lonely_kvfail_s", figs) is None
    assert report.baseline_of("kill_warm_upstream_s", figs) is None


@pytest.mark.parametrize("line", ["", "a=1 loose", "=1", "rounds: 3"])
def test_a_line_without_figures_is_refused(line: str) -> None:
    with pytest.raises(report.BenchError):
        report.parse_figures(line)


def test_figures_are_kept_as_printed() -> None:
    assert report.parse_figures("a=1.50 b=x c=k=v") == {"a": "1.50", "b": "x", "c": "k=v"}


def _scratch_bench(root: Path, body: str) -> None:
    (root / "scratchbench").mkdir()
    (root / "scratchbench" / "__init__.py").write_text("")
    (root / "scratchbench" / "fake.py").write_text(textwrap.dedent(body))


def test_a_bench_run_becomes_a_record_with_its_circumstances(tmp_path: Path) -> None:
    _scratch_bench(
        tmp_path,
        '''
        """A scratch bench that prints a table and its figures.

        More words that are not the summary.
        """
        import sys
        TARGETS = {"ours_x": "<= 2", "absent": "1"}
        BASELINES: dict = {"note": "baseline_x", "ours_x": "absent"}
        print("a table line")
        print("noise", file=sys.stderr)
        print("ours_x=1.0 baseline_x=3 note=" + " ".join(sys.argv[1:]).replace(" ", "_"))
        ''',
    )
    rec = report.run_bench("scratchbench.fake --flag 'two words'", root=tmp_path, timeout_s=60)
    assert rec["bench"] == "scratchbench.fake"
    assert rec["about"] == "A scratch bench that prints a table and its figures."
    assert rec["command"] == "python -m scratchbench.fake --flag 'two words'"
    assert rec["figures"] == {"ours_x": "1.0", "baseline_x": "3", "note": "--flag_two_words"}
    assert rec["targets"] == {"ours_x": "<= 2"}  # a target for no printed figure is dropped
    assert rec["baselines"] == {"note": "baseline_x"}  # so is a baseline it did not print
    assert rec["output"] == ["a table line"] and rec["exit_code"] == 0
    assert rec["machine"]["cores"] >= 1 and rec["machine"]["cpu_model"]
    assert set(rec["load_avg_1min"]) == {"start", "max", "end"}
    assert set(rec["git"]) == {"commit", "dirty"}
    assert rec["started_utc"].endswith("Z") and rec["vllm"] == report.vllm_version()
    json.dumps(rec)  # a record is plain JSON


def test_a_bench_without_a_line_of_figures_leaves_no_record(tmp_path: Path) -> None:
    _scratch_bench(tmp_path, "import sys\nprint('crashed before its figures')\nsys.exit(3)\n")
    with pytest.raises(report.BenchError, match="exit 3"):
        report.run_bench("scratchbench.fake", root=tmp_path, timeout_s=60)
