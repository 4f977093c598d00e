"""Negative controls: connectors broken in exactly ONE way, that the suite must flag.

Why: a conformance suite that passes every connector proves nothing. Each control is a
working connector with one contract rule broken, the way real connectors broke it
upstream; ``conformance/selftest`` runs the suite against each
(``--connector kvfail.conformance.negative:<Class>``) and asserts it is flagged by the
right scenario for the right clause, while the unbroken connector passes.

One module per family, each with the flags the self-test expects of it:

* :mod:`.toy`: the toy (a test double) broken in each way the suite must catch
  (:data:`EXPECTED_FLAGS`, :data:`EXTRA_FLAGS`); fast, they test the oracles in isolation;
* :mod:`.mooncake`: kvfail's REAL Mooncake connector broken in the toy's first ways,
  provoked by a real P process over TCP (:data:`EXPECTED_FLAGS_REAL`);
* :mod:`.store`: store connectors (vLLM's Example and MultiConnector, the Mooncake store,
  kvfail's Example) with a load broken (:data:`EXPECTED_FLAGS_STORE`);
* :mod:`.nixl`: kvfail's REAL NIXL pull connector releasing READs still in flight
  (:data:`EXPECTED_FLAGS_REAL_NIXL`);
* :mod:`.push`: upstream's NIXL push connector with its failures dropped
  (:data:`EXPECTED_FLAGS_PUSH`).

:mod:`.flag` says how a verdict is read as a flag. This package re-exports every control,
so a ``--connector`` value names each as ``kvfail.conformance.negative:<Class>`` whatever
its family; a control whose connector cannot be imported here is absent, and so is its
flag.
"""

from kvfail.conformance.negative import flag, mooncake, nixl, push, store, toy
from kvfail.conformance.negative.flag import *  # noqa: F403
from kvfail.conformance.negative.mooncake import *  # noqa: F403
from kvfail.conformance.negative.nixl import *  # noqa: F403
from kvfail.conformance.negative.push import *  # noqa: F403
from kvfail.conformance.negative.store import *  # noqa: F403
from kvfail.conformance.negative.toy import *  # noqa: F403

__all__ = [
    *flag.__all__,
    *toy.__all__,
    *mooncake.__all__,
    *nixl.__all__,
    *store.__all__,
    *push.__all__,
]
