"""kvfail's ``kvfail_*`` extra-config keys fail at start-up, naming the key.

Why: a key read by hand where it is used is silently ignored when misspelt (a deadline
that never applies strands requests) and a bad value surfaces only when that code runs.
Each connector is constructed here with only a config: validation runs before anything
else, so the error comes before any agent, engine or thread exists.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from connectors.config import (
    MooncakeKvfailConfig,
    NixlPullKvfailConfig,
    NixlPushKvfailConfig,
    validate_extra_config,
)

pytestmark = pytest.mark.vllm


def _connectors() -> list[Any]:
    from connectors.nixl import KvfailNixlConnector, KvfailNixlPushConnector

    built = [KvfailNixlConnector, KvfailNixlPushConnector]
    try:
        from connectors.mooncake import KvfailMooncakeConnector
    except ImportError:  # no Mooncake TransferEngine here: the model is still checked
        return built
    return [*built, KvfailMooncakeConnector]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kvfail_deadline_s": "30"}, "kvfail_deadline_s='30'"),  # a string, not seconds
        ({"kvfail_deadline_s": True}, "kvfail_deadline_s=True"),
        ({"kvfail_deadline_s": -1}, "kvfail_deadline_s=-1"),
        ({"kvfail_quarantine_max_blocks": 2.5}, "kvfail_quarantine_max_blocks=2.5"),
        ({"kvfail_dedline_s": 3}, "kvfail_dedline_s: not a key"),  # misspelt
    ],
)
def test_a_bad_kvfail_key_fails_construction_naming_it(extra: dict[str, Any], named: str) -> None:
    for connector in _connectors():
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
        )
        with pytest.raises(ValueError, match="bad kv_connector_extra_config") as raised:
            connector(config, KVConnectorRole.WORKER, None)
        assert named in str(raised.value), (connector.__name__, str(raised.value))


def test_every_bad_key_is_named_in_one_message() -> None:
    with pytest.raises(ValueError) as raised:
        validate_extra_config(
            {"kvfail_deadline_s": "x", "kvfail_probe_interval": 1}, NixlPullKvfailConfig
        )
    message = str(raised.value)
    assert "kvfail_deadline_s='x'" in message and "kvfail_probe_interval:" in message


def test_a_key_of_another_connector_is_unknown_here() -> None:
    """``kvfail_fence_grace_s`` is Mooncake's; NIXL would ignore it, so it is refused."""
    validate_extra_config({"kvfail_fence_grace_s": 2}, MooncakeKvfailConfig)
    with pytest.raises(ValueError, match="kvfail_fence_grace_s: not a key"):
        validate_extra_config({"kvfail_fence_grace_s": 2}, NixlPushKvfailConfig)


def test_good_values_and_upstream_keys_pass() -> None:
    extra = {
        "kvfail_deadline_s": 30,
        "kvfail_max_hold_s": None,  # off
        "kvfail_probe_interval_s": 0.2,
        "kvfail_quarantine_max_blocks": 512,
        "mooncake_protocol": "tcp",  # upstream's: never looked at
        "backends": ["UCX"],
    }
    checked = validate_extra_config(extra, MooncakeKvfailConfig)
    assert checked.kvfail_deadline_s == 30 and checked.kvfail_quarantine_max_blocks == 512
    validate_extra_config(None, NixlPullKvfailConfig)


def test_import_kvfail_does_not_load_pydantic_config() -> None:
    import subprocess
    import sys

    code = "import sys, kvfail; print('connectors.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
