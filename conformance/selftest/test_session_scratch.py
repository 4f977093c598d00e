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
