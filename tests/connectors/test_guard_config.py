"""The guard's configuration is a pydantic model: a bad key stops start-up, naming it."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic", reason="the guard's config model is pydantic (comes with vLLM)")

from connectors.guard.config import (
    DEFAULT_DEADLINE_S,
    DEFAULT_LOOKUP_DEADLINE_S,
    GuardConfigError,
    lookup_deadline_s,
    parse_guard_config,
)


def test_minimal_config_takes_defaults() -> None:
    config = parse_guard_config({"inner": "MooncakeConnector"})
    assert config.inner == "MooncakeConnector"
    assert config.deadline_s == DEFAULT_DEADLINE_S
    assert config.inner_extra_config == {}
    assert config.quarantine_max_blocks is None
    assert lookup_deadline_s(config) == min(DEFAULT_DEADLINE_S, DEFAULT_LOOKUP_DEADLINE_S)


def test_lookup_deadline_is_its_own_or_the_load_deadline() -> None:
    assert lookup_deadline_s(parse_guard_config({"inner": "X", "deadline_s": 2})) == 2.0
    both = parse_guard_config({"inner": "X", "deadline_s": 2, "lookup_deadline_s": 0.5})
    assert lookup_deadline_s(both) == 0.5


def test_inner_extra_config_is_passed_through_untouched() -> None:
    extra = {"mooncake_protocol": "tcp", "kvfail_deadline_s": 3, "nested": {"a": [1]}}
    config = parse_guard_config({"inner": "m:C", "inner_extra_config": extra, "deadline_s": 3})
    assert config.inner_extra_config == extra
    assert config.deadline_s == 3.0


@pytest.mark.parametrize(
    ("extra", "key", "why"),
    [
        ({"inner": "X", "deadlin_s": 3}, "deadlin_s", "Extra inputs are not permitted"),
        ({"inner": "X", "deadline_s": 0}, "deadline_s", "greater than 0"),
        ({"inner": "X", "deadline_s": -1.5}, "deadline_s", "greater than 0"),
        ({"inner": "X", "deadline_s": "30"}, "deadline_s", "valid number"),
        ({"inner": "X", "deadline_s": True}, "deadline_s", "valid number"),
        ({"inner": "X", "lookup_deadline_s": 0}, "lookup_deadline_s", "greater than 0"),
        (
            {"inner": "X", "quarantine_max_blocks": -1},
            "quarantine_max_blocks",
            "greater than or equal",
        ),
        ({"inner": "X", "quarantine_max_blocks": 2.5}, "quarantine_max_blocks", "integer"),
        ({"inner": "X", "inner_extra_config": [1]}, "inner_extra_config", "dictionary"),
        ({"inner": ""}, "inner", "at least 1 character"),
        ({"deadline_s": 3}, "inner", "Field required"),
    ],
)
def test_bad_config_fails_with_one_message_naming_the_key(
    extra: dict[str, object], key: str, why: str
) -> None:
    with pytest.raises(GuardConfigError) as caught:
        parse_guard_config(extra)
    message = str(caught.value)
    assert message.count("\n") == 0
    assert f"{key!r}" in message and why in message


def test_every_bad_key_is_named_in_the_one_message() -> None:
    with pytest.raises(GuardConfigError) as caught:
        parse_guard_config({"inner": "X", "deadline_s": 0, "typo": 1})
    assert "'deadline_s'" in str(caught.value) and "'typo'" in str(caught.value)
