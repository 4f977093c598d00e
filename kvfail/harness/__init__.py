"""Drive vLLM's real Scheduler and worker-role connectors on CPU (imports vLLM).

``import kvfail`` never imports this package; import it explicitly. See ``engine.py`` for
the per-step call order, ``config.py`` for the CPU settings, ``oracles.py`` for the checks
run after a scenario and ``toy.py`` for the test double used to test the harness itself.
"""

from kvfail.harness.config import BuiltConfig, EngineSpec, build_config, model_dir
from kvfail.harness.engine import (
    Crash,
    Engine,
    EngineCrashedError,
    EngineRecord,
    ForwardHook,
    KVReport,
    OutputRecord,
    RunResult,
    StepRecord,
    Worker,
    ensure_world_of_one,
    prompt_tokens,
)

__all__ = [
    "BuiltConfig",
    "Crash",
    "Engine",
    "EngineCrashedError",
    "EngineRecord",
    "EngineSpec",
    "ForwardHook",
    "KVReport",
    "OutputRecord",
    "RunResult",
    "StepRecord",
    "Worker",
    "build_config",
    "ensure_world_of_one",
    "model_dir",
    "prompt_tokens",
]
