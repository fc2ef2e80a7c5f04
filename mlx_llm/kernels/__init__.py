"""Execution paths of the hot operations (DESIGN §6): attention, the MoE grouped product, the SSM scan and the
loss, each with an exact reference path and the accelerator paths that must equal it to float tolerance.

``Kernels`` names the choice of every path. It is an execution setting, not part of the model: a run trained
with one setting evaluates, decodes and resumes with another. ``"auto"`` is resolved once per backend by
``Kernels.resolve`` (the resolved values are recorded in the run's metadata).
"""

from __future__ import annotations

import dataclasses

import jax

from mlx_llm.config import JsonConfig
from mlx_llm.errors import ConfigError

ATTENTION_IMPLS = ("xla", "flash", "splash", "pallas_gpu", "auto")
MOE_IMPLS = ("block", "ragged_dot", "megablox", "auto")
# Which backend each accelerator kernel runs on (interpret mode runs any of them on the CPU, for tests).
KERNEL_BACKEND = {"splash": "tpu", "pallas_gpu": "gpu", "megablox": "tpu"}


def backend_platform(backend: str | None = None) -> str:
    """"cpu", "gpu" or "tpu" of the default backend (or of ``backend``)."""
    platform = (backend or jax.default_backend()).lower()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform
