"""Fixtures for the rig's tests: the fault-tool tests' leak check, for peer processes."""

from tests.faults.conftest import _no_leaked_peers

__all__ = ["_no_leaked_peers"]
