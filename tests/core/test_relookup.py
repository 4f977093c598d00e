"""The scheduler-side guard that stops the load-fail-reload loop of #55297 (C12)."""

from __future__ import annotations

from kvfail.relookup import RelookupGuard


def test_request_level_failure_vetoes_the_next_lookup() -> None:
    g = RelookupGuard()
    g.loading("r1", [[1, 2]])
    assert g.allows_hit("r1")
    assert g.observe({"r1"}, failed_recving={"r1"}) == {"r1"}
    assert not g.allows_hit("r1")


def test_block_level_failure_is_mapped_back_to_its_request() -> None:
    g = RelookupGuard()
    g.loading("r1", [1, 2, 3])
    g.loading("r2", [4, 5])
    assert g.observe({"r1", "r2"}, invalid_block_ids={5}) == {"r2"}
    assert g.allows_hit("r1") and not g.allows_hit("r2")


def test_blocks_of_a_finished_load_no_longer_map() -> None:
    """Freed blocks are reused by other requests; a later report must not blame r1."""
    g = RelookupGuard()
    g.loading("r1", [1, 2])
    g.observe({"r1"})
    g.observe((), invalid_block_ids={1})
    assert g.allows_hit("r1")


def test_forget_releases_everything() -> None:
    g = RelookupGuard()
    for i in range(100):
        g.loading(f"r{i}", [i])
        g.observe({f"r{i}"}, failed_recving={f"r{i}"})
    for i in range(100):
        g.forget(f"r{i}")
    assert len(g) == 0 and g.allows_hit("r0")


def test_unknown_ids_and_blocks_are_ignored() -> None:
    g = RelookupGuard()
    assert g.observe({"ghost"}, failed_recving=None, invalid_block_ids={99}) == set()
    assert g.observe(None) == set()
