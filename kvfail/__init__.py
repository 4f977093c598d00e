"""kvfail: vLLM's KV-connector load-error contract, implemented once.

``import kvfail`` never imports vLLM: the core is plain Python so it is cheap to import
and to test. vLLM-facing code lives in :mod:`kvfail.harness`, :mod:`kvfail.vllm_stats`
and the ``connectors`` package.
"""

from kvfail.compat import UnsupportedLayoutError
from kvfail.load_records import ALL_PEERS, Failure, StepReport
from kvfail.reporter import FailureReporterMixin
from kvfail.stages import Stage
from kvfail.stats import FailureStats
from kvfail.tracker import LoadTracker

__all__ = [
    "ALL_PEERS",
    "Failure",
    "FailureReporterMixin",
    "FailureStats",
    "LoadTracker",
    "Stage",
    "StepReport",
    "UnsupportedLayoutError",
]
__version__ = "0.1.0"
