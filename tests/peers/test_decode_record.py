"""The byte judgments a pair's record gives the pair drivers' byte oracle."""

from __future__ import annotations

from typing import Any

from kvfail.peers.decode_record import DecodeRecord


def _record(**fields: Any) -> DecodeRecord:
    return DecodeRecord(
        req_id="r", prompt_seed="r", prompt_len=8, params={}, added_at=0.0, **fields
    )


def test_a_load_run_on_p_bytes_has_no_finding() -> None:
    rec = _record(verified=True)
    assert rec.bytes_mismatch() is None
    assert rec.wrong_bytes() is None


def test_a_request_that_never_ran_was_not_checked() -> None:
    assert "never ran" in str(_record().bytes_mismatch())


def test_wrong_loaded_positions_are_named_by_both_judgments() -> None:
    rec = _record(verified=False, mismatches={"rank0:3": [4, 5]})
    assert rec.bytes_mismatch() == "mismatched token positions {'rank0:3': [4, 5]}"
    assert "not P's: positions {'rank0:3': [4, 5]}" in str(rec.wrong_bytes())


def test_a_request_computed_locally_used_no_loaded_byte() -> None:
    rec = _record(verified=False, mismatches={"rank1": [], "rank0": []})
    assert rec.bytes_mismatch() == "r was computed locally on rank(s) [0, 1]: nothing was loaded"
    assert rec.wrong_bytes() is None
