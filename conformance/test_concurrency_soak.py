"""The checkout's entry to ``kvfail.conformance.scenarios.test_concurrency_soak``, which
ships in the package: ``pytest conformance/ --connector X`` runs the same scenarios as
``pytest --pyargs kvfail.conformance --connector X`` from any folder."""

from kvfail.conformance.scenarios.test_concurrency_soak import *  # noqa: F403
