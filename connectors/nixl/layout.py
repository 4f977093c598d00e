"""P's advertised KV layout, checked against D's without ``assert``.

Why this exists: upstream validates a NIXL handshake (``_validate_remote_agent_handshake``)
mostly with ``assert`` statements, and ``python -O`` strips them. A P whose blocks are
laid out differently (another block length, fewer regions) would then be accepted, and
D would READ the wrong byte ranges into its blocks and report the load a success: wrong
KV served, the worst outcome the contract knows. kvfail's NIXL worker runs these checks
after upstream's, as ordinary code, so a mismatch fails the handshake (stage
``handshake``) in every interpreter mode.

Only invariants that hold for every layout upstream supports are checked in general;
block lengths are compared exactly only where P and D must agree byte for byte (same TP
size, same block size, no Mamba state). Heterogeneous TP keeps upstream's checks alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class LayoutMismatch(RuntimeError):
    """P's advertised KV layout cannot be read into D's blocks."""


@dataclass(frozen=True)
class RemoteLayout:
    """The parts of P's handshake metadata that say where its blocks are."""

    base_addrs: Sequence[int]
    block_lens: Sequence[int]
    block_strides: Sequence[int]


def check_remote_layout(
    local_block_lens: Sequence[int],
    remote: RemoteLayout,
    *,
    same_geometry: bool,
    has_mamba: bool,
) -> None:
    """Raise :class:`LayoutMismatch` naming the first way ``remote`` does not fit.

    ``local_block_lens`` are D's block lengths of the regions it transfers, in order.
    ``same_geometry``: P and D have the same TP size and block size, so each remote
    block must be exactly as long as D's.
    """
    n_local = len(local_block_lens)
    if len(remote.base_addrs) != n_local:
        raise LayoutMismatch(
            f"P advertises {len(remote.base_addrs)} KV regions, D transfers {n_local}"
        )
    if len(remote.block_strides) != len(remote.base_addrs):
        raise LayoutMismatch(
            f"P advertises {len(remote.block_strides)} block strides for "
            f"{len(remote.base_addrs)} regions"
        )
    if has_mamba:
        return  # Mamba regions are sized by state, not by block_lens
    if len(remote.block_lens) != n_local:
        raise LayoutMismatch(
            f"P advertises {len(remote.block_lens)} block lengths, D transfers {n_local} regions"
        )
    for i, (stride, length) in enumerate(zip(remote.block_strides, remote.block_lens, strict=True)):
        if stride < length:
            raise LayoutMismatch(f"region {i}: P's block stride {stride} < its length {length}")
    if same_geometry:
        for i, (mine, theirs) in enumerate(zip(local_block_lens, remote.block_lens, strict=True)):
            if mine != theirs:
                raise LayoutMismatch(
                    f"region {i}: P's blocks are {theirs} bytes, D's {mine} (same TP and "
                    "block size: they must match)"
                )
