"""End to end: ``kvfail audit --quick`` over the installed vLLM and over fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfail.audit import cli
from kvfail.audit.source import find_module_file

ROOT = Path(__file__).resolve().parents[2]
needs_vllm_source = pytest.mark.skipif(
    find_module_file("vllm.distributed.kv_transfer.kv_connector.factory") is None,
    reason="vLLM is not installed",
)


def run_cli(*argv: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfail.audit.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.vllm
@needs_vllm_source
def test_quick_json_over_installed_vllm() -> None:
    # Its runtime is never a test assertion: tests do not time the machine.
    rc, out, err = run_cli("--quick", "--format", "json")
    assert rc == 1, err  # upstream connectors violate MUST clauses
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["connectors"]}
    assert len([r for r in rows.values() if r["origin"] == "vllm-registry"]) >= 17

    hf3fs = {f["check"]: f for f in rows["HF3FSKVConnector"]["findings"]}
    assert hf3fs["result_checked"]["status"] == "fail"
    assert hf3fs["result_checked"]["clause"] == "C1"
    assert hf3fs["result_checked"]["tier"] == "STATIC"
    assert hf3fs["result_checked"]["evidence"][0]["path"].endswith("hf3fs/hf3fs_connector.py")
    assert "C1:MUST" in rows["HF3FSKVConnector"]["violations"]

    off = {f["check"]: f for f in rows["OffloadingConnector"]["findings"]}
    assert off["no_assert"]["status"] == "fail"
    assert off["no_assert"]["clause"] == "C13"
    assert "#39732" in off["no_assert"]["resembles"]
    texts = [e["text"] for e in off["no_assert"]["evidence"]]
    assert "assert transfer_result.success" in texts
    assert "C13:MUST" in rows["OffloadingConnector"]["violations"]

    # kvfail's own connectors pass every static check.
    for ours in ("KvfailMooncakeConnector", "KvfailNixlConnector", "KvfailExampleConnector"):
        assert rows[ours]["origin"] == "kvfail"
        assert rows[ours]["violations"] == [], rows[ours]["violations"]

    # Connectors that do report failures are not flagged for C1.
    mooncake = {f["check"]: f for f in rows["MooncakeConnector"]["findings"]}
    assert mooncake["reports"]["status"] == "pass"
    assert "--quick" in err or "[1/" in err  # progress went to stderr, not stdout


@pytest.mark.vllm
@needs_vllm_source
def test_connector_filter_markdown_and_fail_on(tmp_path: Path) -> None:
    out = tmp_path / "m.md"
    rc, _, err = run_cli(
        "--quick", "--format", "markdown", "--connector", "HF3FSKVConnector", "-o", str(out)
    )
    assert rc == 1, err
    text = out.read_text()
    assert "`HF3FSKVConnector`" in text
    assert "OffloadingConnector" not in text
    rc, _, _ = run_cli("--quick", "--connector", "HF3FSKVConnector", "--fail-on", "never")
    assert rc == 0


def test_fixture_rows_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    ok = "tests.audit.fixtures.mixin_good:MixinConnector"
    bad = "tests.audit.fixtures.hardcoded_set:HardcodedSetConnector"
    sys.path.insert(0, str(ROOT))
    try:
        parser = _parser()
        assert cli.run(parser.parse_args(["--quick", "--connector", ok])) == 0
        assert (
            cli.run(parser.parse_args(["--quick", "--connector", ok, "--fail-on", "should"])) == 0
        )
        capsys.readouterr()
        assert cli.run(parser.parse_args(["--quick", "--format", "json", "--connector", bad])) == 1
        doc = json.loads(capsys.readouterr().out)
        assert "C1:MUST" in doc["connectors"][0]["violations"]
    finally:
        sys.path.remove(str(ROOT))


def test_dynamic_tier_default_and_custom_runner(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfail.audit.static import CheckSpec, Finding

    spec = "tests.audit.fixtures.mixin_good:MixinConnector"
    sys.path.insert(0, str(ROOT))
    try:
        parser = _parser()
        # The default runner is the conformance suite; a connector with no transport
        # driver is not run, and its row says why (never a silent empty cell).
        assert cli.run(parser.parse_args(["--connector", spec])) == 0
        out = capsys.readouterr()
        # The whole output on failure: once, under CI load, the row said "not run: no
        # result" (the child wrote no plan), and the truncated message hid the reason.
        assert "dynamic tier not run: no transport driver" in out.out, out.out + out.err

        dyn = CheckSpec("scn_stall", "stalled load", "C2", "MUST", "#50719")
        calls: list[str] = []

        def runner(target: object) -> list[Finding]:
            calls.append(getattr(target, "name", ""))
            return [Finding("scn_stall", "fail", "still waiting", tier="DYNAMIC", check_spec=dyn)]

        args = parser.parse_args(["--format", "json", "--connector", spec])
        assert cli.run(args, dynamic_runner=runner) == 1
        doc = json.loads(capsys.readouterr().out)
        assert calls == ["MixinConnector"]
        cell = doc["connectors"][0]["findings"][-1]
        assert (cell["tier"], cell["clause"], cell["status"]) == ("DYNAMIC", "C2", "fail")
    finally:
        sys.path.remove(str(ROOT))


def _parser():  # type: ignore[no-untyped-def]
    import argparse

    p = argparse.ArgumentParser()
    cli.configure_parser(p)
    p.set_defaults(no_progress=True)
    return p


def test_budget_cut_is_reported_not_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    """A runner whose run was cut by the budget: its not-run cells are unknowns (no exit 1
    from them), and the JSON and stderr say the dynamic tier is incomplete."""
    from kvfail.audit.static import CheckSpec, Finding

    spec = "tests.audit.fixtures.mixin_good:MixinConnector"
    dyn = CheckSpec("dyn:test_x", "x", "-", "MUST", "-")

    class CutRunner:
        def prepare(self, targets: list[object], progress: object = None) -> None:
            assert callable(progress)
            progress("dynamic tier 1/1 (1 s of 2): X test_x[fail]")

        def __call__(self, target: object) -> list[Finding]:
            return [Finding("dyn:test_x", "unknown", "not run", tier="DYNAMIC", check_spec=dyn)]

        def incomplete(self) -> str:
            return "1 of 1 scenarios not run (budget)"

    sys.path.insert(0, str(ROOT))
    try:
        args = _parser().parse_args(["--format", "json", "--connector", spec])
        assert cli.run(args, dynamic_runner=CutRunner()) == 0
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert doc["dynamic_incomplete"] == "1 of 1 scenarios not run (budget)"
        assert doc["connectors"][0]["findings"][-1]["status"] == "unknown"
        assert "dynamic tier incomplete: 1 of 1 scenarios not run (budget)" in err
        args = _parser().parse_args(["--connector", spec])
        cli.run(args, dynamic_runner=CutRunner())
        assert "? 1 not run" in capsys.readouterr().out
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.vllm
@needs_vllm_source
def test_a_driven_row_gets_a_guard_row_after_every_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With the dynamic tier, each row with a driver gets a ``Guard(X)`` row, run after
    every unguarded row and named to the suite as ``guard:`` plus X's value; a row
    without a driver gets none, and --quick adds none."""
    from kvfail.audit.dynamic import conformance_spec

    seen: list[str] = []

    def runner(target: object) -> list[object]:
        seen.append(conformance_spec(target))  # type: ignore[arg-type]
        return []

    argv = ["--format", "json", "--connector", "MooncakeConnector"]
    cli.run(_parser().parse_args([*argv, "--connector", "HF3FSKVConnector"]), runner)
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["connectors"]}
    assert seen == [
        "vllm:MooncakeConnector",
        "vllm:HF3FSKVConnector",
        "guard:vllm:MooncakeConnector",
    ]
    guard = rows["Guard(MooncakeConnector)"]
    assert (guard["origin"], guard["guards"]) == ("guard", "MooncakeConnector")
    assert "Guard(HF3FSKVConnector)" not in rows
    cli.run(_parser().parse_args(["--quick", *argv]))
    rows = {r["name"] for r in json.loads(capsys.readouterr().out)["connectors"]}
    assert rows == {"MooncakeConnector"}


class _Made(Exception):
    """Raised by a stand-in runner class once it has seen its arguments."""


def _capture_runner(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    import kvfail.audit.dynamic as dynamic

    seen: dict[str, object] = {}

    class Capture:
        def __init__(self, **kwargs: object) -> None:
            seen.update(kwargs)
            raise _Made

    monkeypatch.setattr(dynamic, "ConformanceRunner", Capture)
    return seen


def test_budget_counts_from_the_call_in_a_long_lived_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run`` called in a process older than the budget (a test worker, a service) still
    gives the dynamic tier its whole budget. The budget once counted from the process's
    own start, so a worker that had run for eight minutes cut every scenario at once
    ("not run: no result"), depending only on when the test was scheduled."""
    monkeypatch.setattr(cli, "_process_age_s", lambda: 10_000.0)
    seen = _capture_runner(monkeypatch)
    before = time.monotonic()
    with pytest.raises(_Made):
        cli.run(_parser().parse_args(["--connector", "nosuch.mod:Foo"]))
    assert isinstance(seen["start"], float) and seen["start"] >= before


def test_the_command_counts_its_own_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvfail audit`` as a command: interpreter start-up and imports are part of the
    budget, so the budget is the command's wall time."""
    monkeypatch.setattr(cli, "_process_age_s", lambda: 7.0)
    seen = _capture_runner(monkeypatch)
    with pytest.raises(_Made):
        cli.main(["--connector", "nosuch.mod:Foo"])
    assert isinstance(seen["start"], float) and seen["start"] <= time.monotonic() - 7.0
