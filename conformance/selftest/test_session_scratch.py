"""A pytest session run inside another (the selftest's pytester runs) shares its host's
scratch: it must leave the host's IPC directory in place when it ends, or the host's next
TP world cannot bind its message queue."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfail.rig import shm


def test_an_inner_session_leaves_its_hosts_ipc_directory(pytester: pytest.Pytester) -> None:
    host = Path(os.environ[shm.IPC_ENV])
    assert host.is_dir()
    pytester.makepyfile("def test_nothing_to_see():\n    assert True\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
    assert os.environ[shm.IPC_ENV] == str(host)
    assert host.is_dir(), "an inner session removed the IPC directory of its host"


def test_an_inner_session_keeps_its_hosts_shared_memory_snapshot(
    pytester: pytest.Pytester,
) -> None:
    """The host's end-of-session sweep looks at every segment created since the host
    began. A segment made after that (here: one standing in for a live P's queue) must
    stay in the sweep's view through an inner session, so that it is swept once its P is
    killed: the inner session must not add it to the snapshot."""
    from multiprocessing import shared_memory

    from kvfail.conformance import plugin

    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert segment.name not in plugin._SHM_BEFORE
        pytester.makepyfile("def test_nothing_to_see():\n    assert True\n")
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
        result.assert_outcomes(passed=1)
        assert segment.name not in plugin._SHM_BEFORE, "an inner session hid a host segment"
    finally:
        segment.close()
        segment.unlink()
