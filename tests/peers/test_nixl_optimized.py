"""Under ``python -O`` kvfail's NIXL D still refuses a P whose KV layout is not its own.

Why: upstream's handshake validation is mostly ``assert`` statements, which ``-O`` strips;
a P advertising blocks of another length would then be read into D's blocks and the load
reported a success. kvfail's worker re-checks the layout as ordinary code
(``connectors/nixl/layout.py``). The D runs in a child interpreter started with ``-O``
(``tests/peers/nixl_layout_under_O.py``) against a real P process over UCX; this test,
in a normal interpreter, judges what it prints. Upstream's ``NixlConnector`` runs the same
fault beside it: under ``-O`` it reports the load a success and runs on wrong KV. Slow:
two vLLM imports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.child_pytest import run_child
from tests.transports import require_transport

require_transport("nixl")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def test_layout_mismatch_fails_the_handshake_without_asserts() -> None:
    proc = run_child(
        [sys.executable, "-O", "-m", "tests.peers.nixl_layout_under_O"], cwd=ROOT, timeout_s=400
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("RESULT ", "ERROR "))]
    assert lines and lines[-1].startswith("RESULT "), (
        f"rc={proc.returncode} {lines}\n{proc.stderr[-3000:]}"
    )
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["debug"] is False, "the child ran with assertions on: -O did not apply"
    mine = out["kvfail"]
    assert mine["bad_answers"] == 1, f"P did not serve kvfail's D the bad layout: {out}"
    assert mine["ended"] == "predicate" and mine["failed"] is True, out
    assert mine["verified"] is None, f"D ran on KV it should have refused: {out}"
    assert mine["stages"] == {"stage.handshake": 1}, out
    # kvfail's check refused it (upstream's assert was stripped): its reason names it.
    assert any("LayoutMismatch" in ln and "stage='handshake'" in ln for ln in mine["log"]), out
    # The finding, held to: upstream's D under -O takes the same P's blocks, half as long as
    # its own, reports the load a success and runs on wrong KV. Only judged when its
    # handshake reached P (a loaded machine can time out zmq's 5 s receive first).
    theirs = out["upstream"]
    if theirs["bad_answers"] == 1 and theirs["ended"] == "predicate":
        assert theirs["failed"] is False and theirs["verified"] is False, (
            f"upstream under -O no longer serves wrong KV from a mismatched P: {theirs}"
        )
