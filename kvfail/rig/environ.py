"""Environment variables set for the length of a ``with`` block, then put back.

Why: some upstream constructors read their settings from the environment once (a D's
advertised address, a store's configuration), and several engines with different
settings are built in one process; each must see its own and leave no trace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["environ_set"]


@contextlib.contextmanager
def environ_set(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` applied inside the block; each key's earlier value (or
    its absence) is restored after it, also when the block raises."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
