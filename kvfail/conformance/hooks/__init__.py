"""The conformance pytest plugin, one job per module.

``kvfail.conformance.plugin`` (the ``pytest11`` entry point) only gathers the hooks these
modules define: ``options`` (command line and ini), ``state`` (the session's drivers and
records), ``lifecycle`` (configure, parametrise, the fixture, stop drivers, close),
``verdicts`` (what each scenario's outcome means), ``coverage`` (the clauses a run may
judge), ``baselines`` (matching known findings), ``reporting`` (the matrix and report
files, written as the run goes) and ``shm_sweep`` (shared memory the run leaves).
"""
