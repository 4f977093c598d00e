"""``kvfail.rig.patches``: each patch site records itself, and every report lists it.

A verdict reached on a patched system must say so. What is checked: the two patch sites
record when (and only when) they change something, records from another process reach
the log, and the conformance report, its Markdown, the audit's parsing of a child's
report and the audit's output all name what was recorded. No vLLM, torch or NIXL here
(the shim's torch is a stand-in); the plugin end to end is in ``test_report_patches.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvfail.conformance.report import render_patches
from kvfail.rig import nixl_progress
from kvfail.rig import patches as rig_patches
from kvfail.rig.patches import CATALOGUE, LOG_ENV, read_log, record, summarize


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "patches.jsonl"
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


def test_every_catalogue_entry_says_what_why_and_how_to_do_without() -> None:
    for name, patch in CATALOGUE.items():
        assert patch.name == name
        assert patch.target and patch.change and patch.why and patch.without
        assert patch.site.startswith("kvfail.")


def test_an_unknown_patch_name_is_refused() -> None:
    with pytest.raises(KeyError, match="not a known rig patch"):
        record("a_patch_nobody_described")


def test_records_from_this_and_another_process_reach_the_log(log: Path) -> None:
    before = len(rig_patches.recorded())
    record("nixl_progress_delay", "100 µs")
    assert rig_patches.recorded()[before:][0].name == "nixl_progress_delay"
    code = "from kvfail.rig import patches; patches.record('cpu_accelerator_index', 'x')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    apps, offset = read_log(log)
    assert [a.name for a in apps] == ["nixl_progress_delay", "cpu_accelerator_index"]
    assert len({a.pid for a in apps}) == 2
    assert offset == log.stat().st_size
    # Reading on from the offset returns only what came later; a cut line waits.
    with log.open("a") as fh:
        fh.write('{"name": "nixl_progress_delay", "pid": 1, "process": "p"')
    assert read_log(log, offset) == ([], offset)


@pytest.mark.parametrize(
    ("argv0", "label"),
    [
        ("/repo/kvfail/peers/nixl_producer.py", "kvfail.peers.nixl_producer"),
        ("kvfail.peers.producer", "kvfail.peers.producer"),  # a fork of the P zygote
        ("/venv/lib/python3.11/site-packages/pytest/__main__.py", "pytest"),
        ("/venv/bin/pytest", "pytest"),
    ],
)
def test_a_record_names_the_process_it_came_from(
    monkeypatch: pytest.MonkeyPatch, argv0: str, label: str
) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    assert rig_patches._process_label() == label


def test_summary_counts_processes_in_catalogue_order(log: Path) -> None:
    apps = [
        rig_patches.Application("nixl_progress_delay", 1, "pytest", "100 µs"),
        rig_patches.Application("cpu_accelerator_index", 1, "pytest"),
        rig_patches.Application("nixl_progress_delay", 2, "kvfail.peers.nixl_producer", "100 µs"),
    ]
    summary = summarize(apps)
    assert [s["name"] for s in summary] == [n for n in CATALOGUE if n in {a.name for a in apps}]
    nixl = next(s for s in summary if s["name"] == "nixl_progress_delay")
    assert (nixl["applied"], nixl["processes"], nixl["details"]) == (2, 2, ["100 µs"])
    assert nixl["where"] == ["kvfail.peers.nixl_producer", "pytest"]
    assert nixl["touches_connector"] is True
    # Made only in P processes (D ran with KVFAIL_NIXL_PTHR_DELAY_US=0): D is untouched.
    only_p = summarize([apps[2]])
    assert only_p[0]["touches_connector"] is False
    assert "the rig's P processes only" in render_patches(only_p)


class _Accelerator:
    """torch.accelerator on a CPU-only machine: asking for the device raises."""

    def is_available(self) -> bool:
        return False

    def current_device_index(self) -> int:
        raise RuntimeError("Cannot access accelerator device when none is available")


def test_the_cpu_shim_records_only_when_the_stand_in_answered(
    log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfail.rig.cpu_shim import cpu_accelerator_index_shim

    accel = _Accelerator()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(accelerator=accel))
    with cpu_accelerator_index_shim():  # a connector that never asks: nothing changed
        pass
    assert read_log(log)[0] == []
    with cpu_accelerator_index_shim():
        assert accel.current_device_index() == 0
        assert accel.current_device_index() == 0
    with pytest.raises(RuntimeError):  # restored on exit
        accel.current_device_index()
    apps = read_log(log)[0]
    assert [(a.name, a.detail) for a in apps] == [("cpu_accelerator_index", "answered 0 2x")]


def test_the_nixl_delay_records_each_agent_it_changed(log: Path) -> None:
    class Binding:
        def nixlAgent(self, name: str, config: Any) -> str:
            return f"agent {name} delay {config.pthrDelay}"

    wrapped = nixl_progress._DelayedAgents(Binding(), 100)
    spinning = types.SimpleNamespace(useProgThread=True, pthrDelay=0)
    assert wrapped.nixlAgent("a", spinning) == "agent a delay 100"
    no_thread = types.SimpleNamespace(useProgThread=False, pthrDelay=0)
    wrapped.nixlAgent("b", no_thread)  # unchanged: not recorded
    own_delay = types.SimpleNamespace(useProgThread=True, pthrDelay=7)
    wrapped.nixlAgent("c", own_delay)  # a delay someone chose: left alone, not recorded
    apps = read_log(log)[0]
    assert [(a.name, a.detail) for a in apps] == [("nixl_progress_delay", "100 µs")]


def test_the_conformance_report_lists_the_patches(tmp_path: Path) -> None:
    from kvfail.conformance.report import Record, render_patches, write_report

    summary = summarize([rig_patches.Application("nixl_progress_delay", 1, "pytest", "100 µs")])
    summary[0]["connectors"] = ["vllm:NixlConnector"]
    rec = Record(
        connector="vllm:NixlConnector",
        scenario="test_x",
        policy="fail",
        outcome="passed",
        reason="",
        clauses=["C1"],
        duration_s=0.1,
        rig_patches=["nixl_progress_delay"],
    )
    json_path, md_path = write_report(tmp_path, [rec], rig_patches=summary)
    assert json.loads(json_path.read_text())[0]["rig_patches"] == ["nixl_progress_delay"]
    listed = json.loads((tmp_path / "rig_patches.json").read_text())
    assert [p["name"] for p in listed] == ["nixl_progress_delay"]
    assert listed[0]["connectors"] == ["vllm:NixlConnector"]
    md = md_path.read_text()
    assert "## Rig patches" in md and "`nixl_progress_delay`" in md
    text = render_patches(summary)
    assert text.startswith("nixl_progress_delay: ") and "without it: " in text
    # No patch: the report says the system ran unpatched, rather than saying nothing.
    write_report(tmp_path, [rec])
    assert "ran unpatched" in md_path.read_text()
    assert json.loads((tmp_path / "rig_patches.json").read_text()) == []
    assert "unpatched" in render_patches([])


def _audit_with(patches: list[dict[str, Any]] | None, note: str | None = None) -> Any:
    from kvfail.audit.report import Audit

    return Audit(rows=[], columns=[], dynamic_note=note, rig_patches=patches)


def test_the_audit_lists_the_patches_its_child_ran_under(tmp_path: Path) -> None:
    from kvfail.audit import dynamic
    from kvfail.audit.inventory import Target
    from kvfail.audit.report import render_json, render_markdown, render_table

    spec = "vllm:NixlConnector"
    (tmp_path / "plan.json").write_text(json.dumps({"run": [spec], "not_run": {}}))
    rec = {
        "connector": spec,
        "scenario": "test_a",
        "policy": "fail",
        "outcome": "passed",
        "reason": "",
        "clauses": ["C1"],
        "duration_s": 1.0,
        "rig_patches": ["nixl_progress_delay"],
    }
    # A child stopped before its session's end wrote records only: the patches are read
    # from them and described from the catalogue.
    (tmp_path / dynamic.RECORDS).write_text(json.dumps(rec) + "\n")
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner._read(tmp_path, "")
    assert runner.rig_patches is not None
    assert [p["name"] for p in runner.rig_patches] == ["nixl_progress_delay"]
    assert runner.rig_patches[0]["connectors"] == [spec]
    target = Target(
        name="NixlConnector", module="m", class_name="NixlConnector", origin="vllm-registry"
    )
    runner(target)
    assert any("rig patches: nixl_progress_delay" in n for n in target.notes)

    table = render_table(_audit_with(runner.rig_patches))
    assert "Rig patches (what the dynamic tier's rig changed" in table
    assert "nixl_progress_delay: " in table
    assert "## Rig patches" in render_markdown(_audit_with(runner.rig_patches))
    doc = json.loads(render_json(_audit_with(runner.rig_patches)))
    assert [p["name"] for p in doc["rig_patches"]] == ["nixl_progress_delay"]
    assert "none recorded" in render_table(_audit_with([]))
    # The static tier runs nothing and patches nothing; a runner that does not say: silent.
    assert "Rig patches" not in render_table(_audit_with(None, note="skipped (--quick)"))
    assert "Rig patches" not in render_table(_audit_with(None))
