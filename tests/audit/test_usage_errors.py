"""Bad ``kvfail audit`` input is a usage error: exit 2, one stderr line that names the bad
value and what is accepted, no traceback, no report, and no tier started.

The commands run without ``--quick`` and with progress on, so a connector that slipped
through would start the dynamic tier and print progress lines.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvfail.audit import cli
from kvfail.audit.inventory import UsageError, discover
from kvfail.audit.source import SourceIndex

ROOT = Path(__file__).resolve().parents[2]
ACCEPTED = ("vllm:<RegistryName>", "kvfail.connectors entry point", "module:Class")
# The real ``kvfail`` command (audit as a subcommand) and the standalone entry point.
ENTRIES = {
    "kvfail": [sys.executable, "-m", "kvfail.cli", "audit"],
    "standalone": [sys.executable, "-m", "kvfail.audit.cli"],
}


def _usage_error(entry: str, *argv: str) -> str:
    proc = subprocess.run(
        [*ENTRIES[entry], *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvfail audit: error: ")
    return lines[0]


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize(
    ("connector", "problem"),
    [
        ("nosuch.mod:Foo", "cannot import module 'nosuch.mod' (ModuleNotFoundError"),
        ("json:NoSuchClass", "module 'json' has no attribute 'NoSuchClass'"),
        ("json:dumps", "'dumps' in module 'json' is a function"),
        ("json:decoder", "'decoder' in module 'json' is a module, not a class"),
        ("json:JSONDecoder", "is a class but not a KV connector"),
        ("json:", "empty module or class name"),
        ("NotAConnector", "unknown connector name (known: "),
        ("vllm:NoSuchConnector", "'NoSuchConnector' is not in vLLM's connector registry"),
    ],
)
def test_bad_connector(entry: str, connector: str, problem: str) -> None:
    line = _usage_error(entry, "--connector", connector)
    assert f"--connector {connector}: " in line
    assert problem in line
    assert all(a in line for a in ACCEPTED), line


def test_bad_connector_among_good_ones_rejects_the_run() -> None:
    good = "tests.audit.fixtures.mixin_good:MixinConnector"
    line = _usage_error("standalone", "--connector", good, "--connector", "nosuch.mod:Foo")
    assert "--connector nosuch.mod:Foo: " in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--layout", "tp3"], "argument --layout: unknown layout 'tp3': use tp1, tp2, tp1-g2"),
        (["--layout", "tp1,tp9"], "unknown layout 'tp9': use tp1, tp2, tp1-g2, tp2-g2, p2d1, p1d2"),
        (["--policy", "sometimes"], "invalid choice: 'sometimes' (choose from 'fail', 'recompute'"),
        (["--format", "xml"], "invalid choice: 'xml' (choose from 'json', 'markdown', 'table')"),
        (["--fail-on", "may"], "invalid choice: 'may' (choose from 'must', 'should', 'never')"),
        (["--budget-s", "-1"], "invalid value '-1': expected a number of seconds >= 0"),
        (["--budget-s", "nan"], "invalid value 'nan': expected a number of seconds >= 0"),
        (["--workers", "-1"], "invalid value '-1': expected a whole number of workers >= 0"),
        (["--workers", "two"], "invalid value 'two': expected a whole number of workers >= 0"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_option_value(argv: list[str], expected: str) -> None:
    for entry in ENTRIES:
        assert expected in _usage_error(entry, *argv)


def test_rejected_before_any_tier(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    class Spy:
        def prepare(self, targets: object, progress: object = None) -> None:
            calls.append("prepare")

        def __call__(self, target: object) -> list[object]:
            calls.append("call")
            return []

    p = argparse.ArgumentParser()
    cli.configure_parser(p)
    assert cli.run(p.parse_args(["--connector", "nosuch.mod:Foo"]), dynamic_runner=Spy()) == 2
    out, err = capsys.readouterr()
    assert calls == [] and out == ""
    assert len(err.splitlines()) == 1 and "nosuch.mod:Foo" in err


def test_layout_values_the_suite_accepts_still_parse() -> None:
    p = argparse.ArgumentParser()
    cli.configure_parser(p)
    args = p.parse_args(["--layout", "tp1,tp2-g2", "--layout", "all", "--budget-s", "0"])
    assert args.layout == ["tp1,tp2-g2", "all"] and args.budget_s == 0


def test_class_with_unreadable_bases_gets_the_benefit_of_the_doubt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bases from a package that is not installed cannot be read: audited, not rejected.
    A base chain read to its end without vLLM's interface is rejected."""
    (tmp_path / "kvfail_usage_mod.py").write_text(
        "from not_installed_pkg import Base\n"
        "class Plain:\n    pass\n"
        "class Child(Plain):\n    pass\n"
        "class Opaque(Base):\n    pass\n"
        "NUMBER = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    index = SourceIndex()
    (target,) = discover(index, selectors=["kvfail_usage_mod:Opaque"])
    assert target.installed and target.origin == "cli"
    with pytest.raises(UsageError, match="kvfail_usage_mod:Child is a class but not a KV"):
        discover(index, selectors=["kvfail_usage_mod:Child"])
    with pytest.raises(UsageError, match="'NUMBER' in module 'kvfail_usage_mod' is assigned"):
        discover(index, selectors=["kvfail_usage_mod:NUMBER"])
    with pytest.raises(UsageError, match="cannot import 'Base' from 'not_installed_pkg'"):
        discover(index, selectors=["kvfail_usage_mod:Base"])


def test_a_class_a_package_re_exports_with_a_star_import_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pkg:Class`` where ``pkg/__init__.py`` does ``from .part import *`` (how kvfail's
    negative controls are packaged): the source index follows the star import, and a name
    no part defines is still an error."""
    pkg = tmp_path / "kvfail_star_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from kvfail_star_pkg.part import *  # noqa\n")
    (pkg / "part.py").write_text("class Plain:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    index = SourceIndex()
    found = index.resolve_class("kvfail_star_pkg", "Plain")
    assert found is not None and found.module.name == "kvfail_star_pkg.part"
    assert index.resolve_class("kvfail_star_pkg", "Missing") is None
