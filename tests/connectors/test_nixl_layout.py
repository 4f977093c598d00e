"""kvfail's NIXL layout check, the one that survives ``python -O`` (no vLLM needed)."""

from __future__ import annotations

import pytest

from connectors.nixl.layout import LayoutMismatch, RemoteLayout, check_remote_layout

D_LENS = [4096, 4096]


def _remote(lens: list[int], strides: list[int] | None = None, n_addrs: int = 2) -> RemoteLayout:
    return RemoteLayout(list(range(n_addrs)), lens, strides if strides is not None else lens)


def test_matching_layout_passes() -> None:
    check_remote_layout(D_LENS, _remote(D_LENS), same_geometry=True, has_mamba=False)


def test_halved_blocks_are_refused_when_geometry_is_the_same() -> None:
    """The suite's ``layout`` fault: P advertises blocks half as long as D's."""
    with pytest.raises(LayoutMismatch, match="region 0: P's blocks are 2048 bytes, D's 4096"):
        check_remote_layout(D_LENS, _remote([2048, 2048]), same_geometry=True, has_mamba=False)


def test_other_block_lengths_are_left_to_upstream_under_heterogeneous_tp() -> None:
    """With another TP size the lengths legitimately differ (head split)."""
    check_remote_layout(D_LENS, _remote([2048, 2048]), same_geometry=False, has_mamba=False)


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        (_remote(D_LENS, n_addrs=1), "P advertises 1 KV regions, D transfers 2"),
        (_remote(D_LENS, strides=[4096]), "1 block strides for 2 regions"),
        (RemoteLayout([0, 1], [4096], [4096, 4096]), "1 block lengths, D transfers 2"),
        (_remote(D_LENS, strides=[4096, 1024]), "region 1: P's block stride 1024 < its length"),
    ],
)
def test_structural_mismatches_are_refused_in_every_geometry(
    remote: RemoteLayout, message: str
) -> None:
    with pytest.raises(LayoutMismatch, match=message):
        check_remote_layout(D_LENS, remote, same_geometry=False, has_mamba=False)


def test_mamba_regions_skip_the_block_length_checks() -> None:
    """Mamba state pages are sized by ``ssm_sizes``; upstream validates those."""
    check_remote_layout(D_LENS, _remote([1, 2], strides=[1, 2]), same_geometry=True, has_mamba=True)


def test_a_mismatch_is_a_runtime_error() -> None:
    """Upstream's handshake path turns any exception into ``handshake_failed``; a
    ``RuntimeError`` (not an ``AssertionError``) also survives ``python -O``."""
    assert issubclass(LayoutMismatch, RuntimeError)
