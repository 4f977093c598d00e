"""KvfailExampleConnector's file checks, on real files, without an engine.

Why: the store scenarios (``conformance/test_store_faults.py --connector example``) show
each fault end to end once; these pin the rule each one depends on, fast: a file is trusted
only when its bytes are the ones its digest names, and every other outcome is a
:class:`StoreError` with a reason (never another exception, which would be reported as
``internal``), and a load names every block its slots touch.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable in this environment")

import torch
from safetensors.torch import save_file

from connectors.example.connector import (
    StoreError,
    digest_path,
    load_blocks,
    read_verified,
    write_digest,
)
from kvfail.conformance.store_driver import damage
from kvfail.faults.points import FaultPoint


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    tensor = torch.arange(96 * 2 * 4, dtype=torch.float16).reshape(96, 2, 4)
    path = tmp_path / "layer.safetensors"
    save_file({"kv_cache": tensor}, str(path))
    write_digest(path)
    return path, tensor


def test_a_file_with_its_digest_loads_byte_exact(stored: tuple[Path, torch.Tensor]) -> None:
    path, tensor = stored
    assert torch.equal(read_verified(path), tensor)
    assert not list(path.parent.glob(".*.tmp"))  # the digest's temporary name is gone


@pytest.mark.parametrize(
    ("point", "reason"),
    [
        (FaultPoint.STORE_FILE_DELETED, "file is gone"),
        (FaultPoint.STORE_FILE_TRUNCATED, "digest mismatch"),
        (FaultPoint.STORE_GARBAGE_HEADER, "digest mismatch"),
        (FaultPoint.STORE_REPLACED_BY_DIR, "is a directory"),
        (FaultPoint.STORE_DATA_OVERWRITTEN, "digest mismatch"),
    ],
    ids=lambda v: v.value if isinstance(v, FaultPoint) else None,
)
def test_each_store_fault_is_a_store_error(
    stored: tuple[Path, torch.Tensor], point: FaultPoint, reason: str
) -> None:
    path, _ = stored
    damage(path, point)
    with pytest.raises(StoreError, match=reason):
        read_verified(path)


def test_no_digest_is_not_trusted(stored: tuple[Path, torch.Tensor]) -> None:
    path, _ = stored
    digest_path(path).unlink()
    with pytest.raises(StoreError, match="no digest"):
        read_verified(path)


def test_garbage_under_a_matching_digest_is_still_refused(tmp_path: Path) -> None:
    """A digest proves the bytes are the ones saved, not that they parse."""
    path = tmp_path / "layer.safetensors"
    path.write_bytes(b"\x00" * 64)
    write_digest(path)
    with pytest.raises(StoreError, match="not a safetensors file"):
        read_verified(path)


def test_a_load_names_every_block_its_slots_touch() -> None:
    slots = torch.tensor([32 * 5 + i for i in range(32)] + [32 * 2 + i for i in range(10)])
    assert load_blocks(SimpleNamespace(slot_mapping=slots), 32) == [5, 2]  # type: ignore[arg-type]
