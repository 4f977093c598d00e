"""The audit's dynamic tier is the conformance suite itself, run in a child process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _needs_vllm() -> None:
    pytest.importorskip("vllm", reason="the dynamic tier drives vLLM's real Scheduler")


@pytest.mark.vllm
def test_dynamic_tier_passes_the_toy_and_flags_a_swallowing_connector() -> None:
    _needs_vllm()
    cmd = [
        sys.executable,
        "-m",
        "kvfail.audit.cli",
        "--format",
        "json",
        "--no-progress",
        "--budget-s",
        "0",  # a loaded machine must not turn this into a budget test
        "--connector",
        "kvfail.harness.toy:ToyConnector",
        "--connector",
        "kvfail.conformance.negative:SwallowsFailure",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]  # the control violates a MUST clause
    rows = {r["name"]: r for r in json.loads(done.stdout)["connectors"]}
    toy = [f for f in rows["ToyConnector"]["findings"] if f["tier"] == "DYNAMIC"]
    bad = [f for f in rows["SwallowsFailure"]["findings"] if f["tier"] == "DYNAMIC"]
    assert toy and all(f["status"] in ("pass", "n/a") for f in toy)
    # Every scenario module of the package reached the toy's row with cells of its own.
    from kvfail.conformance.scenarios import DIRECTORY

    judged = {Path(f["evidence"][0]["path"].split("::")[0]).name for f in toy if f["evidence"]}
    assert {p.name for p in DIRECTORY.glob("test_*.py")} <= judged
    failed = {f["check"] for f in bad if f["status"] == "fail"}
    assert "dyn:test_failed_load_one_group" in failed
    reason = next(f["summary"] for f in bad if f["check"] == "dyn:test_failed_load_one_group")
    assert "C2" in reason or "liveness" in reason


# --------------------------------------------------------------------------- budget, cut


def _write(tmp: Path, name: str, obj: object) -> None:
    (tmp / name).write_text(json.dumps(obj))


def _target(name: str = "X") -> Any:
    from kvfail.audit.inventory import Target

    return Target(name=name, module="pkg.mod", class_name=name, origin="cli")


def test_scenarios_the_child_never_reached_are_not_run_cells(tmp_path: Path) -> None:
    """A cut run: every cell that exists came from report.json; the rest say why not."""
    from kvfail.audit import dynamic
    from kvfail.audit.report import Row, _dynamic_cell

    spec = "pkg.mod:X"
    _write(tmp_path, "plan.json", {"run": [spec], "not_run": {}, "alias": {}})
    scenarios = ["test_a", "test_b", "test_c"]
    _write(
        tmp_path,
        "collected.json",
        [{"connector": spec, "policy": "fail", "scenario": s, "nodeid": s} for s in scenarios],
    )
    _write(tmp_path, "budget.json", {"reason": "not run (budget): spent"})
    rec = {"connector": spec, "policy": "fail", "clauses": ["C2"], "duration_s": 1.5}
    _write(
        tmp_path,
        "report.json",
        [
            {**rec, "scenario": "test_a", "outcome": "passed", "reason": ""},
            {**rec, "scenario": "test_b", "outcome": "failed", "reason": "C2 liveness"},
        ],
    )
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner._read(tmp_path, "")
    target = _target()
    found = {f.check: f for f in runner(target)}
    assert found["dyn:test_a"].status == "pass"
    assert found["dyn:test_b"].status == "fail" and "liveness" in found["dyn:test_b"].summary
    assert found["dyn:test_c"].status == "unknown"
    assert found["dyn:test_c"].summary.startswith("not run (budget)")
    assert found["dyn:test_c"].violation is None  # not a result either way
    assert (
        "dynamic tier: 1 of 3 scenario runs not run (budget; rerun with a larger --budget-s)"
        in (target.notes)
    )
    assert any("2 scenario runs (2 scenarios; fail tp1) in 3.0 s" in n for n in target.notes)
    assert _dynamic_cell(Row(target, list(found.values()))) == "FAIL 1/2 +1 not run"
    assert runner.incomplete() == "1 of 3 scenario runs not run (budget): spent"

    # Two layouts, the second cut: a pass in one layout is no pass (unknown); a failure
    # in one layout is a finding whatever the other would have said.
    _write(
        tmp_path,
        "collected.json",
        [
            {"connector": spec, "policy": "fail", "layout": lay, "scenario": s, "nodeid": s}
            for s in ("test_a", "test_b")
            for lay in ("tp1", "tp2-g2")
        ],
    )
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner._read(tmp_path, "")
    found = {f.check: f for f in runner(_target())}
    assert found["dyn:test_a"].status == "unknown"
    assert "(fail tp2-g2); ran: passed [fail tp1]" in found["dyn:test_a"].summary
    assert found["dyn:test_b"].status == "fail"
    assert found["dyn:test_b"].evidence[0].text == "fail tp1=failed, fail tp2-g2=not run"
    assert runner.incomplete() == "2 of 4 scenario runs not run (budget): spent"

    # Budget spent before the first scenario: the plugin writes no report; not an error.
    (tmp_path / "report.json").unlink()
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner._read(tmp_path, "")
    target = _target()
    cells = runner(target)
    assert runner.error is None
    assert [f.status for f in cells] == ["unknown"] * 2
    assert _dynamic_cell(Row(target, cells)) == "? 2 not run"


def test_a_harness_error_is_unknown_never_a_pass_or_a_verdict(tmp_path: Path) -> None:
    """A scenario the tool could not judge (``error``: a vLLM without a feature the
    harness needs) reads as unknown, with the missing feature named: next to a pass it
    is no pass; next to a real failure the failure is the verdict."""
    from kvfail.audit import dynamic
    from kvfail.compat import MISSING_FEATURE_MARK

    spec = "pkg.mod:X"
    gap = f"harness error, not a verdict: x needs y (block_pool_binding), {MISSING_FEATURE_MARK}"
    _write(tmp_path, "plan.json", {"run": [spec], "not_run": {}, "alias": {}})
    records = [
        ("test_a", "fail", "error", gap),
        ("test_a", "recompute", "passed", ""),
        ("test_b", "fail", "error", gap),
        ("test_b", "recompute", "failed", "C2 liveness"),
    ]
    _write(
        tmp_path,
        "collected.json",
        [{"connector": spec, "policy": p, "scenario": s, "nodeid": s} for s, p, _o, _r in records],
    )
    _write(
        tmp_path,
        "report.json",
        [
            {"connector": spec, "policy": p, "scenario": s, "outcome": o, "reason": r,
             "clauses": ["C2"], "duration_s": 1.0}
            for s, p, o, r in records
        ],
    )  # fmt: skip
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner._read(tmp_path, "")
    found = {f.check: f for f in runner(_target())}
    assert found["dyn:test_a"].status == "unknown"
    assert "block_pool_binding" in found["dyn:test_a"].summary
    assert found["dyn:test_b"].status == "fail" and "liveness" in found["dyn:test_b"].summary


FAKE_CHILD = r"""
import json, os, signal, subprocess, sys, time
tmp = sys.argv[1]
with open(os.path.join(tmp, "progress.jsonl"), "a") as fh:
    fh.write(json.dumps({"event": "collected", "n": 2, "connectors": 1}) + "\n")
    fh.write(json.dumps({"event": "start", "i": 1, "connector": "c", "policy": "fail",
                         "scenario": "test_x"}) + "\n")
# A peer as the suite starts them: its own session, frozen (SIGSTOP) like a frozen P.
peer = subprocess.Popen(
    [sys.executable, "-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); "
     "time.sleep(600)"],
    start_new_session=True,
)
with open(os.path.join(tmp, "pids"), "w") as fh:
    fh.write(f"{os.getpid()} {peer.pid}")
if sys.argv[2] == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a teardown that never ends
    time.sleep(600)
time.sleep(3)  # "exit": a run that ends without closing its (frozen) peer
"""


def _gone(pid: int) -> bool:
    from kvfail.rig.procfs import proc_state

    return proc_state(pid) in (None, "Z")


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_child_and_its_peers_never_outlive_the_audit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Past the budget the child is stopped (SIGTERM, then SIGKILL) and so is every peer it
    started in its own session, frozen or not; a peer a finished child left behind is
    killed too. The child's progress lines reach the progress callback."""
    from kvfail.audit import dynamic

    monkeypatch.setattr(dynamic, "TERM_GRACE_S", 1.0)
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    runner = dynamic.ConformanceRunner(budget_s=10)
    shown: list[str] = []
    kill_at = time.monotonic() + (4.0 if mode == "hang" else 60.0)
    runner._run_child(
        [sys.executable, str(script), str(tmp_path), mode], tmp_path, kill_at, shown.append
    )
    child, peer = (int(p) for p in (tmp_path / "pids").read_text().split())
    try:
        assert _gone(child)
        assert _gone(peer), "the peer outlived the audit"
        assert any("dynamic tier 1/2" in s and "test_x[fail tp1]" in s for s in shown), shown
        if mode == "hang":
            assert runner.error is not None and "stopped" in runner.error
        else:
            assert runner.error is None
            assert len(runner.leftovers) == 1  # the peer it left: killed, and said so
    finally:
        for pid in (child, peer):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


FAKE_SUITE = """
import pytest

# One xdist_group per connector, as the suite marks them (inert without xdist).
PAIRS = [pytest.param(c, "fail", marks=pytest.mark.xdist_group("kvfail-" + c)) for c in "ab"]


@pytest.mark.parametrize(("kvfail_connector", "kvfail_policy"), PAIRS)
def test_one(kvfail_connector, kvfail_policy, record):
    record("one", kvfail_connector)


@pytest.mark.parametrize(("kvfail_connector", "kvfail_policy"), PAIRS)
def test_two(kvfail_connector, kvfail_policy, record):
    record("two", kvfail_connector)
"""

#: The fake suites' fixture: each scenario run appends ``name[connector]`` to ran.txt.
RECORD_FIXTURE = """

@pytest.fixture
def record(request):
    def rec(name, connector):
        with open(request.config.rootpath / "ran.txt", "a") as fh:
            fh.write(f"{name}[{connector}]\\n")
    return rec
"""
FAKE_SUITE += RECORD_FIXTURE

RUN_FAKE = """
import sys, time
from pathlib import Path
import pytest
from kvfail.audit.dynamic_child import audit_plugin
report, stop = Path(sys.argv[1]), float(sys.argv[2])
plugin = audit_plugin(["a", "b"], report, time.monotonic() + stop if stop else None)
args = [str(report / "test_fake.py"), "-q", "-p", "no:kvfail", "-p", "no:cacheprovider"]
sys.exit(pytest.main([*args, "--rootdir", str(report), "-c", str(report / "tox.ini")],
                     plugins=[plugin]))
"""


def _run_fake(
    tmp_path: Path, script: str, budget: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """Run the fake suite under the child's plugin (``budget``: none, or spent at once);
    returns the run and its progress events, having checked the collected order."""
    (tmp_path / "test_fake.py").write_text(FAKE_SUITE)
    (tmp_path / "tox.ini").write_text("[pytest]\n")
    stop = "0" if budget == "none" else "0.000001"
    cmd = [sys.executable, "-c", script, str(tmp_path), stop]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = json.loads((tmp_path / "collected.json").read_text())
    assert [c["connector"] for c in collected] == ["a", "a", "b", "b"], done.stdout[-2000:]
    events = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    return done, events


@pytest.mark.parametrize("budget", ["none", "spent"])
def test_child_plugin_runs_connector_by_connector_within_its_budget(
    tmp_path: Path, budget: str
) -> None:
    """The child's plugin (no vLLM: a fake parametrised suite): connector-major order,
    a progress line per scenario, and past its budget no scenario starts."""
    done, events = _run_fake(tmp_path, RUN_FAKE, budget)
    assert events[0] == {"event": "collected", "n": 4, "connectors": 2}
    ran = tmp_path / "ran.txt"
    if budget == "none":
        assert done.returncode == 0, done.stdout[-2000:]
        assert ran.read_text().split() == ["one[a]", "two[a]", "one[b]", "two[b]"]
        starts = [(e["i"], e["connector"], e["scenario"]) for e in events[1:]]
        assert starts == [
            (1, "a", "test_one"),
            (2, "a", "test_two"),
            (3, "b", "test_one"),
            (4, "b", "test_two"),
        ]
        assert not (tmp_path / "budget.json").exists()
    else:
        assert done.returncode == 2, done.stdout[-2000:]  # interrupted: the budget
        assert not ran.exists()  # no scenario started
        assert events[1:] == [{"event": "budget", "not_run": 4}]
        assert "budget" in json.loads((tmp_path / "budget.json").read_text())["reason"]


RUN_FAKE_XDIST = """
import json, os, sys, time
from pathlib import Path
import pytest
from kvfail.audit.dynamic_child import PLUGIN_ENV
report, stop = Path(sys.argv[1]), float(sys.argv[2])
os.environ[PLUGIN_ENV] = json.dumps(
    {"run": ["a", "b"], "report": str(report), "stop_at": time.monotonic() + stop if stop else None}
)
args = [str(report / "test_fake.py"), "-q", "-p", "no:kvfail", "-p", "no:cacheprovider"]
args += ["-p", "kvfail.audit.dynamic_child", "-n", "2", "--dist", "loadgroup"]
sys.exit(pytest.main([*args, "--rootdir", str(report), "-c", str(report / "tox.ini")]))
"""


@pytest.mark.parametrize("budget", ["none", "spent"])
def test_child_plugin_paces_xdist_workers(tmp_path: Path, budget: str) -> None:
    """On xdist workers (the child's default where xdist is installed) the plugin is
    registered in each worker from the environment: one collected line, one start line
    per scenario, and past the budget no worker starts a scenario."""
    pytest.importorskip("xdist")
    done, events = _run_fake(tmp_path, RUN_FAKE_XDIST, budget)
    assert [e for e in events if e["event"] == "collected"] == [
        {"event": "collected", "n": 4, "connectors": 2}
    ]
    ran = tmp_path / "ran.txt"
    if budget == "none":
        assert done.returncode == 0, done.stdout[-2000:]
        assert sorted(ran.read_text().split()) == ["one[a]", "one[b]", "two[a]", "two[b]"]
        # Each scenario's place in the run, though loadgroup renames items after collection.
        assert sorted(e["i"] for e in events if e["event"] == "start") == [1, 2, 3, 4]
        assert not (tmp_path / "budget.json").exists()
    else:
        assert done.returncode == 2, done.stdout[-2000:]  # interrupted: the budget
        assert not ran.exists()  # no scenario started on either worker
        assert not [e for e in events if e["event"] == "start"]
        assert {json.dumps(e) for e in events if e["event"] == "budget"} == {'{"event": "budget"}'}
        assert "budget" in json.loads((tmp_path / "budget.json").read_text())["reason"]


GUARD_SUITE = (
    """
import pytest

PAIRS = [("a", "fail"), ("guard:a", "fail")]


@pytest.mark.clauses("C2", "C10")
@pytest.mark.parametrize(("kvfail_connector", "kvfail_policy"), PAIRS)
def test_deadline(kvfail_connector, kvfail_policy, record):
    record("deadline", kvfail_connector)


@pytest.mark.clauses("C1")
@pytest.mark.parametrize(("kvfail_connector", "kvfail_policy"), PAIRS)
def test_other(kvfail_connector, kvfail_policy, record):
    record("other", kvfail_connector)
"""
    + RECORD_FIXTURE
)


def test_a_guard_row_runs_only_the_deadline_scenarios(tmp_path: Path) -> None:
    """The child's plugin runs a ``guard:`` connector's scenarios citing C10 only (the
    deadline and stranding ones), and every scenario of the others."""
    (tmp_path / "test_fake.py").write_text(GUARD_SUITE)
    (tmp_path / "tox.ini").write_text("[pytest]\nmarkers =\n    clauses: cited clauses\n")
    script = RUN_FAKE.replace('["a", "b"]', '["a", "guard:a"]')
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    ran = (tmp_path / "ran.txt").read_text().split()
    assert ran == ["deadline[a]", "other[a]", "deadline[guard:a]"]
    collected = json.loads((tmp_path / "collected.json").read_text())
    assert [c["connector"] for c in collected] == ["a", "a", "guard:a"]


def test_a_connectors_driver_stops_after_its_last_scenario(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The conformance plugin stops a connector's driver once its last scenario is done
    (its idle P would cost CPU for the rest of the run), exactly once, and closes the P's
    its kind handed off only when no connector still to run has a driver of that kind."""
    from kvfail.conformance import plugin
    from kvfail.conformance import shared_producers as driver_module

    closed: list[type | None] = []
    monkeypatch.setattr(
        driver_module,
        "close_shared_producers",
        lambda handed_off_by=None: closed.append(handed_off_by),
    )

    class KindA:
        stops = 0

        def stop(self) -> None:
            self.stops += 1

    class KindB(KindA):
        pass

    drivers = {"a": KindA(), "b": KindB(), "c": KindA()}
    state = plugin._State(
        connectors=list(drivers), policies=["fail"], layouts=[], report_dir=None, silent_wait_s=1
    )
    state.drivers, state.started = dict(drivers), set(drivers)
    state.last_index = {"a": 3, "b": 5, "c": 7}
    plugin._release(state, "a", 3)
    plugin._release(state, "a", 3)  # already stopped: not again
    assert [d.stops for d in drivers.values()] == [1, 0, 0]
    assert closed == []  # "c" still runs, and it is of a's kind: it takes a's P over
    plugin._release(state, "b", 5)
    assert closed == [KindB]  # no later connector of b's kind
    plugin._release(state, "c", 7)
    assert closed == [KindB, KindA]
    assert [d.stops for d in drivers.values()] == [1, 1, 1] and state.started == set()


def test_finished_scenarios_survive_a_killed_child(tmp_path: Path) -> None:
    """The conformance plugin appends each record to records.jsonl as its scenario ends;
    without report.json (a child SIGKILLed before the session's end) the audit reads those,
    a cut line aside."""
    from kvfail.audit import dynamic
    from kvfail.conformance.report import Record, append_record

    SPEC = "pkg.mod:X"  # _target()'s spec
    for scenario, outcome, reason in (
        ("test_one", "passed", ""),
        ("test_two", "failed", "C2 liveness"),
    ):
        append_record(
            tmp_path,
            Record(SPEC, scenario, "fail", outcome, reason, clauses=["C2"], duration_s=1.0),
        )
    with (tmp_path / dynamic.RECORDS).open("a") as fh:
        fh.write('{"connector": "a", "scen')  # SIGKILL mid-line
    _write(
        tmp_path,
        "collected.json",
        [
            {"connector": SPEC, "policy": "fail", "scenario": s, "nodeid": s}
            for s in ("test_one", "test_two", "test_three")
        ],
    )
    runner = dynamic.ConformanceRunner(budget_s=10)
    runner.error = "the conformance run was stopped at --budget-s 10 (...)"
    runner._read(tmp_path, "")
    cells = {f.check: f.status for f in runner(_target())}
    assert cells == {"dyn:test_one": "pass", "dyn:test_two": "fail", "dyn:test_three": "unknown"}


def test_the_audit_runs_every_scenario_module(tmp_path: Path) -> None:
    """The gate: every module pytest would collect from the scenarios package is in the
    child's command, so a module added there cannot be left out of the audit's matrix."""
    from kvfail.audit.dynamic_child import suite_args
    from kvfail.conformance.scenarios import DIRECTORY

    modules = {
        p.name
        for p in DIRECTORY.iterdir()
        if p.suffix == ".py" and (p.name.startswith("test_") or p.stem.endswith("_test"))
    }
    assert {"test_concurrency.py", "test_concurrency_soak.py", "test_quarantine.py"} <= modules
    args = suite_args(["a"], tmp_path, "fail", ["tp1"])
    passed = [Path(a) for a in args if a.endswith(".py")]
    assert all(p.parent == DIRECTORY for p in passed)
    assert not modules - {p.name for p in passed}, "scenario modules the audit does not run"
    assert passed[0].name == "test_scenarios.py"  # the core stories first: a budget cuts tails


def test_the_child_runs_a_row_more_than_the_machine_has_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row mostly waits, so the child's default is cores + 1 workers, capped; a
    ``--workers`` value is taken as given, 0 (serial) included, and one core is serial."""
    pytest.importorskip("xdist")
    from kvfail.audit import dynamic_child

    for cores, expected in ((1, 0), (2, 3), (3, 4), (64, dynamic_child.MAX_WORKERS)):
        monkeypatch.setattr(dynamic_child.os, "cpu_count", lambda c=cores: c)
        assert dynamic_child.workers() == expected
    assert dynamic_child.workers(0) == 0 and dynamic_child.workers(2) == 2


def test_each_guard_row_runs_right_after_the_row_it_wraps() -> None:
    """A guard row costs about what its inner's row costs: run last, the slowest one ended
    the audit alone. The matrix's order is kept otherwise, so a budget cut still takes
    the last rows (kvfail's own) whole."""
    from kvfail.audit.dynamic import run_order

    specs = ["vllm:A", "vllm:B", "vllm:C", "mine:K", "guard:vllm:A", "guard:vllm:C", "guard:x:Z"]
    assert run_order(specs) == [
        "vllm:A",
        "guard:vllm:A",
        "vllm:B",
        "vllm:C",
        "guard:vllm:C",
        "mine:K",
        "guard:x:Z",  # its inner is not in this run: kept, last
    ]
