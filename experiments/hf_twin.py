"""The transformers model with exactly our weights, for the side-by-side benchmarks (bench_train, bench_decode).

It goes through the library's own exporter (``mlx_llm.interop``: config.json + model.safetensors in a temporary
directory, then ``from_pretrained``), so the baseline is the checkpoint a user would load. Needs the ``hf`` extra
(``pip install torch==2.13.0 && pip install -e '.[hf]'``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.interop import hf_config, hf_weights

SPECIAL_IDS = {"bos": 0, "eos": 1, "pad": 2}


def hf_twin(params, cfg: ModelConfig, *, threads: int | None = None):
    """(model, torch) — ``LlamaForCausalLM`` / ``MambaForCausalLM`` / ``MixtralForCausalLM`` in float32 on the
    CPU, torch eager (no ``torch.compile``), default attention implementation (SDPA)."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    arch = hf_config.architecture(cfg)
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in hf_weights.to_hf(_numpy(params), cfg, arch).items()}
    with tempfile.TemporaryDirectory() as d:
        save_file(tensors, str(Path(d) / "model.safetensors"), metadata={"format": "pt"})
        (Path(d) / "config.json").write_text(json.dumps(hf_config.to_hf(cfg, arch, SPECIAL_IDS, {})))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return model, torch


def try_hf_twin(params, cfg: ModelConfig):
    """``hf_twin`` or None (with the reason printed) when the extra is missing or transformers has no such model."""
    from mlx_llm.errors import MLXLLMError

    try:
        return hf_twin(params, cfg)
    except ImportError as exc:
        print(f"(no HF baseline: {exc}; install the hf extra)")
    except MLXLLMError as exc:
        print(f"(no HF baseline: {exc})")
    return None


def _numpy(params):
    import jax

    return jax.tree.map(np.asarray, params)
