"""The built-in rollout engine: any Hugging Face causal LM, on CPU or CUDA, no extra install.

`BuiltinEngine` and `EngineConfig` are also importable from `yatt.rollout`. `sample_tokens` is the
engine's on-device sampler (counter-based randomness, no host syncs, capturable in a CUDA graph),
for a decode loop of one's own that should sample as the engine does.
"""

from yatt.rollout.builtin._adapter_binding import AdapterBinding
from yatt.rollout.builtin._config import EngineConfig
from yatt.rollout.builtin._engine import BuiltinEngine
from yatt.rollout.builtin._sampling import sample_tokens

__all__ = ["AdapterBinding", "BuiltinEngine", "EngineConfig", "sample_tokens"]
