"""mlx_llm: a complete small LLM as pure JAX functions over parameter pytrees.

The public names below are imported on first use (PEP 562), so that ``import mlx_llm.cli`` — and with it
``mlx-llm --help`` — does not import jax: the configs and the command line are plain Python.
"""

import importlib

from mlx_llm.config import ModelConfig
from mlx_llm.errors import CheckpointError, ConfigError, DataError, InputError, MLXLLMError

_LAZY = {"init_params": "mlx_llm.model", "forward": "mlx_llm.model", "generate": "mlx_llm.decode.generate",
         "examples": "mlx_llm.examples", "open_run": "mlx_llm.runs.record", "load_params": "mlx_llm.runs.load"}

__all__ = [
    "ModelConfig", "init_params", "forward", "generate", "examples", "open_run", "load_params",
    "MLXLLMError", "ConfigError", "InputError", "DataError", "CheckpointError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mlx_llm' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name == "examples" else getattr(module, name)
    globals()[name] = value
    return value
