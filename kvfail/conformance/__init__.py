"""The kvfail conformance suite's library: capabilities, drivers, report and pytest plugin.

Why a library next to the tests in ``conformance/``: a connector author runs the suite as
``pytest conformance/ --connector X`` against *their* connector, so the parts that decide
what runs (capabilities derived from the class, the driver that provokes faults) and what
is reported (the per-connector matrix) must be importable and reusable by out-of-tree
drivers (entry-point group ``kvfail.drivers``). Importing this package does not import vLLM;
the submodules that need it import it lazily.
"""

from kvfail.conformance.capabilities import CAPABILITY_NAMES, Capabilities, CapabilityMissing

__all__ = ["CAPABILITY_NAMES", "Capabilities", "CapabilityMissing"]
