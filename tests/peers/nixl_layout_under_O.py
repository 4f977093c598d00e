"""Run with ``python -O -m tests.peers.nixl_layout_under_O``: D without its ``assert``s.

Why a separate process: ``-O`` is an interpreter flag, and pytest's own assertions vanish
under it, so the judging stays in ``test_nixl_optimized.py`` (a normal interpreter), which
reads the one JSON line this prints. D engines run here, P (upstream's connector) in its
own process as always; P's side channel answers every handshake with blocks half as long
as D's (the suite's ``layout`` fault). kvfail's D goes first, then upstream's
``NixlConnector``, whose layout checks are ``assert`` statements: the finding.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

SIDES = {
    "kvfail": ("KvfailNixlConnector", "connectors.nixl"),
    "upstream": ("NixlConnector", None),
}


class _Lines(logging.Handler):
    """kvfail's log lines, which carry the failure's stage and reason."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run() -> dict[str, Any]:
    from kvfail.peers.nixl import HANDSHAKE_TIMEOUT_S, NixlPair

    out: dict[str, Any] = {"debug": __debug__}
    lines = _Lines()
    logging.getLogger("kvfail").addHandler(lines)
    pair = NixlPair(build_default_consumer=False)
    try:
        for side, (connector, module) in SIDES.items():
            pair.consumer("fail", name=side, connector=connector, connector_module=module)
        params = {side: pair.prefill(f"layout-{side}", 100) for side in SIDES}
        pair.serve_bad_metadata("layout")
        for side in SIDES:  # one at a time: each cold D handshakes with P's side channel
            rid = f"layout-{side}"
            pair.add(rid, params[side], consumer=side)
            result = pair.run([rid], consumer=side, timeout_s=HANDSHAKE_TIMEOUT_S + 25)
            rec = pair.records[rid]
            worker = pair.decoders[side].workers[0].connector.connector_worker
            stats = worker.failure_stats().as_dict() if side == "kvfail" else {}
            out[side] = {
                "ended": result.reason,
                "failed": rec.failed,
                "verified": rec.verified,
                "stages": {k: v for k, v in stats.items() if k.startswith("stage.") and v},
                "log": [ln for ln in lines.lines if rid in ln],
                "bad_answers": pair.serve_bad_metadata("layout"),  # served so far
            }
        pair.serve_bad_metadata(None)
    finally:
        pair.close()
    return out


def main() -> None:
    code = 0
    try:
        print("RESULT " + json.dumps(run()), flush=True)
    except BaseException as exc:  # report, then leave without nixl's exit segfault
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        code = 1
    sys.stderr.flush()
    os._exit(code)  # a process holding nixl agents segfaults at a normal exit


if __name__ == "__main__":
    main()
