"""The conformance scenarios, shipped in the package so the suite runs wherever kvfail is
installed: ``pytest --pyargs kvfail.conformance --connector X`` from any folder. The
checkout's ``conformance/`` runs the same modules (``pytest conformance/ --connector X``).

Modules: ``test_scenarios`` (one failure story each), ``test_concurrency`` (many loads at
once, two peers, races), ``test_concurrency_soak`` (the seeded soak), ``test_quarantine`` (a
slow peer's late write) and ``test_store_faults`` (a KV store's faults).
Importing this package imports no vLLM; the modules import it when pytest collects them.
"""

from pathlib import Path

#: Where the scenario modules are, for a child or inner pytest run that names the files.
DIRECTORY = Path(__file__).resolve().parent
