"""What a process that forks engines imports first: vLLM, and the default engine's model
configuration already built.

Why: building a ``ModelConfig`` inspects the model class, which costs about a second and a
half even with vLLM's model-info cache on disk, and a whole vLLM import in a subprocess
when that cache is cold or was written by another vLLM release. The P zygote
(``kvfail.peers.producer_handle.P_PRELOAD``) imports this module once, so every P forked
from it finds the configuration in :func:`kvfail.harness.config._model_config`'s cache instead of
building it again at each P (re)start.
"""

from __future__ import annotations

from kvfail.harness.config import EngineSpec, _model_config

_DEFAULT = EngineSpec()
_model_config(_DEFAULT.model, _DEFAULT.max_model_len, _DEFAULT.seed)
