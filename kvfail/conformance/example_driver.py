"""Deprecated: the old name of :mod:`kvfail.conformance.store_driver`.

Kept because installed ``kvfail.drivers`` entry points (metadata written before the move,
until the next install) and out-of-tree code name this module.
"""

from kvfail.conformance.store_driver import *  # noqa: F403
from kvfail.conformance.store_driver import __all__  # noqa: F401
