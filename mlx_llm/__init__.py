"""mlx_llm: a complete small LLM as pure JAX functions over parameter pytrees."""

from mlx_llm import examples
from mlx_llm.config import ModelConfig
from mlx_llm.decode.generate import generate
from mlx_llm.errors import CheckpointError, ConfigError, DataError, InputError, MLXLLMError
from mlx_llm.model import forward, init_params

__all__ = [
    "ModelConfig", "init_params", "forward", "generate", "examples",
    "MLXLLMError", "ConfigError", "InputError", "DataError", "CheckpointError",
]
__version__ = "0.1.0"
