"""The harness engine's processes run torch with one intra-op thread unless the user chose.

Why it matters: the harness's forward and byte oracles are small tensor operations, which
a thread per core only slows down (``kvfail.harness.threads``); and a user's own
``OMP_NUM_THREADS`` or ``KVFAIL_TORCH_THREADS`` must still win.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvfail.harness.threads import TORCH_THREADS_ENV, set_harness_threads  # noqa: E402


@pytest.fixture
def pool_of_two() -> Iterator[None]:
    """This process's pool at two threads for the test, as it was afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 1),
        ({"OMP_NUM_THREADS": "2"}, 2),
        ({TORCH_THREADS_ENV: "2"}, 2),
        ({TORCH_THREADS_ENV: "1", "OMP_NUM_THREADS": "2"}, 1),
    ],
)
def test_one_thread_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, pool_of_two: None, env: dict[str, str], expected: int
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(TORCH_THREADS_ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert set_harness_threads() == expected
    assert torch.get_num_threads() == expected
