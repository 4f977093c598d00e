"""Negative control on NIXL push: upstream's NixlPushConnector with its failures dropped.

Upstream's NixlPushConnector on D, driven by the push driver (P WRITEs into D's blocks).
Its control drops every failure its worker found, so a push that never came is reported
as a finished load; flagged where upstream's push D passes
(``conformance/selftest/test_push_controls.py``).
"""

from __future__ import annotations

from kvfail.conformance.negative.drops import DropsLoadErrors
from kvfail.conformance.negative.flag import Flag

__all__ = ["EXPECTED_FLAGS_PUSH", "PUSH_REFERENCE"]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPushConnector as _NixlPush,
    )
except Exception:  # NIXL's module imports the nixl package, which may be missing
    _NixlPush = None

if _NixlPush is not None:

    class DropsPushLoadErrors(DropsLoadErrors, _NixlPush):  # type: ignore[misc,valid-type]
        """NixlPushConnector that reports every load its worker failed as finished: no
        failed block, no failed request."""

    __all__ += ["DropsPushLoadErrors"]

#: The unbroken reference of the push controls.
PUSH_REFERENCE = "vllm:NixlPushConnector"
#: Push controls: class -> its flag (empty where NIXL cannot be imported).
EXPECTED_FLAGS_PUSH: dict[str, Flag] = (
    {"DropsPushLoadErrors": Flag("test_failed_load_one_group", "C1 unreported")}
    if _NixlPush is not None
    else {}
)
