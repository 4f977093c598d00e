"""Drive vLLM's real Scheduler and worker-role connectors on CPU (imports vLLM).

``import kvfail`` never imports this package; import it explicitly. See ``engine.py`` for
the per-step call order, ``workers.py`` for how each TP rank is built, ``requests.py`` for
the prompts and requests it serves, ``records.py`` for what it records, ``config.py`` for
the CPU settings, ``oracles.py`` for the checks run after a scenario and ``toy.py`` for the
test double used to test the harness itself.
"""

from kvfail.harness import records
from kvfail.harness.config import BuiltConfig, EngineSpec, build_config, model_dir
from kvfail.harness.engine import Engine, ForwardHook
from kvfail.harness.records import *  # noqa: F403 - records.__all__ names what it exports, once
from kvfail.harness.requests import prompt_tokens
from kvfail.harness.workers import Worker, ensure_world_of_one

__all__ = [
    "BuiltConfig",
    "Engine",
    "EngineSpec",
    "ForwardHook",
    "Worker",
    "build_config",
    "ensure_world_of_one",
    "model_dir",
    "prompt_tokens",
]
__all__ += records.__all__
