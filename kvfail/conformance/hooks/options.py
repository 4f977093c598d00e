"""The suite's command-line and ini options, and how each is read."""

from __future__ import annotations

import pytest

DEFAULT_CONNECTOR = "toy"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfail", "kvfail KV-connector conformance suite")
    group.addoption(
        "--connector",
        action="append",
        default=[],
        help="connector to test: toy | mooncake | vllm:<RegistryName> | module:Class | a "
        "kvfail.drivers entry point (repeatable; replaces the ini option kvfail_connectors, "
        f"whose default is {DEFAULT_CONNECTOR})",
    )
    parser.addini(
        "kvfail_connectors",
        type="args",
        default=[],
        help="connectors the suite runs when no --connector is given (space-separated; "
        f"empty: {DEFAULT_CONNECTOR})",
    )
    group.addoption(
        "--policy",
        choices=("fail", "recompute", "both"),
        default="both",
        help="kv_load_failure_policy to run each scenario under (default both)",
    )
    group.addoption(
        "--layout",
        action="append",
        default=[],
        help="engine layout(s) to run each scenario in: tp1 | tp2 | p2d1 | p1d2 (P's TP, "
        "D's TP), each with an optional -g2 (two KV-cache groups), or all (repeatable or "
        "comma-separated; LAYOUT:POLICY limits a "
        "layout to one policy, e.g. tp2-g2:recompute; replaces the ini option "
        "kvfail_layouts, whose default is tp1)",
    )
    parser.addini(
        "kvfail_layouts",
        type="args",
        default=[],
        help="layouts the suite runs when no --layout is given (empty: tp1)",
    )
    group.addoption(
        "--kvfail-report",
        metavar="DIR",
        default=None,
        help="write report.json, report.md and capabilities.json to DIR (kept up to date "
        "as scenarios end, and finished on any exit)",
    )
    group.addoption(
        "--kvfail-baseline",
        metavar="FILE",
        default=None,
        help="TOML file of known findings to accept, each pinned to a connector class, "
        "scenario, policy, layout and the fingerprints (clause, check, stage) of its findings "
        "(see kvfail.conformance.baseline); an entry that no longer fails, or whose scenario "
        "skipped, fails the run",
    )
    group.addoption(
        "--kvfail-write-baseline",
        metavar="FILE",
        default=None,
        help="write this run's contract violations as a baseline file",
    )
    group.addoption(
        "--kvfail-require-drivers",
        action="store_true",
        default=None,
        help="a driver that cannot run here (transport absent) fails its scenarios instead "
        "of skipping them (also the ini option kvfail_require_drivers)",
    )
    parser.addini(
        "kvfail_require_drivers",
        type="bool",
        default=False,
        help="as --kvfail-require-drivers",
    )
    group.addoption(
        "--kvfail-silent-wait",
        type=float,
        default=6.0,
        help="seconds the suite waits for a connector's own deadline on a silent peer (default 6)",
    )
    group.addoption(
        "--kvfail-seed",
        type=int,
        default=None,
        help="seed of the soak's fault plan, request ids and prompts (default: the suite's "
        "fixed seed); a failing soak prints the seed to replay it with -k soak",
    )
    group.addoption(
        "--kvfail-soak-batches",
        type=int,
        default=None,
        help="batches the soak runs (default 15); its plan for fewer batches is the "
        "first part of the full one (the audit runs 5)",
    )


def drivers_required(config: pytest.Config) -> bool:
    """Whether an absent transport fails instead of skipping: ``--kvfail-require-drivers``,
    else the ini ``kvfail_require_drivers``. One reading for the suite and for any test
    module that needs a transport, so the project's CI cannot skip one silently."""
    require = config.getoption("--kvfail-require-drivers", default=None)
    if require is not None:
        return bool(require)
    try:
        return bool(config.getini("kvfail_require_drivers"))
    except ValueError:  # the option is not registered (plugin loaded late)
        return False


def layouts(config: pytest.Config) -> list[str]:
    """``--layout`` values; else the ini list ``kvfail_layouts`` (parsed by the caller)."""
    given = list(config.getoption("--layout", default=[]) or [])
    if given:
        return given
    try:
        return [str(v) for v in config.getini("kvfail_layouts")]
    except ValueError:  # the option is not registered (plugin loaded late)
        return []


def connectors(config: pytest.Config) -> list[str]:
    """``--connector`` values; else the ini list ``kvfail_connectors``; else the toy."""
    given = list(config.getoption("--connector", default=[]) or [])
    if given:
        return given
    try:
        ini = [str(c) for c in config.getini("kvfail_connectors")]
    except ValueError:  # the option is not registered (plugin loaded late)
        ini = []
    return ini or [DEFAULT_CONNECTOR]


def soak_batches(config: pytest.Config) -> int | None:
    """``--kvfail-soak-batches``, checked: a soak of no batch would judge nothing."""
    value = config.getoption("--kvfail-soak-batches", default=None)
    if value is not None and value < 1:
        raise pytest.UsageError(f"--kvfail-soak-batches must be at least 1, got {value}")
    return value
