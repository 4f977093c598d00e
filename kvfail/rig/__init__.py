"""The rig's process, shared-memory and patch utilities.

The package is layered so that a reader can tell the product from the test bench:

* the contract, at the package root: ``tracker``, ``reporter``, ``stages``, ``stats``,
  ``blocks``, ``compat``, ``deadline``, ``quarantine`` and their vLLM-facing halves
  ``vllm_stats`` / ``vllm_quarantine``. A connector imports these and nothing else;
* the rig: ``kvfail.harness`` (vLLM's real Scheduler and engines), ``kvfail.faults``,
  ``kvfail.peers`` (real P processes) and this package: the peer processes a fault kills
  or freezes (:mod:`.processes`), what ``/proc`` shows of them (:mod:`.procfs`), their
  stacks (:mod:`.stacks`) and ports (:mod:`.ports`), the zygote they are forked from
  (:mod:`.zygote`), the loopback-only address check (:mod:`.loopback`), the names and
  clean-up of shared memory (:mod:`.shm`), NIXL's
  progress-thread pause (:mod:`.nixl_progress`), the CPU stand-in for one torch call
  (:mod:`.cpu_shim`) and the record of every change the rig makes to the system under
  test (:mod:`.patches`);
* conformance (``kvfail.conformance``) and the audit (``kvfail.audit``), built on both.

Importing this package imports nothing; each module says what it imports.
"""
