"""A driver written against a renamed optional member (``late_write``, ``used_wrong_bytes``)
keeps its oracle: the suite calls the new name, which serves the old method, with a
deprecation warning at class definition."""

from __future__ import annotations

import pytest

from kvfail.conformance.driver import RENAMED
from tests.conformance.minimal_driver import MinimalDriver


def test_an_old_member_name_serves_the_new_one() -> None:
    with pytest.warns(DeprecationWarning) as caught:

        class OldNames(MinimalDriver):
            def used_wrong_bytes(self, engine: object, request_id: str) -> str | None:
                return f"wrong bytes for {request_id}"

            def late_write(self, engine: object, request_id: str) -> str | None:
                return f"late write for {request_id}"

    assert sorted(str(w.message).split(": name it ")[1] for w in caught) == sorted(RENAMED.values())
    driver = OldNames.__new__(OldNames)
    assert driver.wrong_bytes_finding(None, "r1") == "wrong bytes for r1"  # type: ignore[arg-type]
    assert driver.late_write_finding(None, "r1") == "late write for r1"  # type: ignore[arg-type]


def test_a_driver_with_the_new_names_is_left_alone() -> None:
    class NewNames(MinimalDriver):
        def wrong_bytes_finding(self, engine: object, request_id: str) -> str | None:
            return "new"

    assert NewNames.wrong_bytes_finding is vars(NewNames)["wrong_bytes_finding"]
    assert not any(hasattr(NewNames, old) for old in RENAMED)


def test_the_old_store_driver_module_serves_installed_entry_points() -> None:
    """Entry-point metadata installed before the move names ``example_driver``: it must load
    the very factories ``store_driver`` holds."""
    from kvfail.conformance import example_driver, store_driver

    assert example_driver.__all__ == store_driver.__all__
    for name in store_driver.__all__:
        assert getattr(example_driver, name) is getattr(store_driver, name), name
