"""Execution paths of the hot operations (DESIGN §6): attention, the MoE grouped product, the SSM scan and the
loss, each with an exact reference path and the accelerator paths that must equal it to float tolerance.

``Kernels`` names the choice of every path. It is an execution setting, not part of the model: a run trained
with one setting evaluates, decodes and resumes with another. ``"auto"`` is resolved once per backend by
``Kernels.resolve`` (the resolved values are recorded in the run's metadata).
"""

from __future__ import annotations

import dataclasses

from mlx_llm.errors import ConfigError
from mlx_llm.settings import JsonConfig

ATTENTION_IMPLS = ("xla", "flash", "splash", "pallas_gpu", "auto")  # Kernels.attention_impl
MOE_IMPLS = ("block", "ragged_dot", "megablox", "auto")  # Kernels.moe_impl
SSM_SCANS = ("fused", "associative", "chunked", "auto")  # ModelConfig.ssm_scan: how the Mamba recurrence runs
# Which backend each accelerator kernel runs on (interpret mode runs any of them on the CPU, for tests).
KERNEL_BACKEND = {"splash": "tpu", "pallas_gpu": "gpu", "megablox": "tpu"}


def backend_platform(backend: str | None = None) -> str:
    """"cpu", "gpu" or "tpu" of the default backend (or of ``backend``). jax is imported here, not at the top:
    this module (the choice of paths, a config) is imported by the configs, which stay jax-free."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    platform = backend.lower()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def _choose(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"Kernels.{name} = {value!r} is invalid: valid values are {list(valid)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernels(JsonConfig):
    """How the hot operations run (DESIGN §6); hashable, so a static argument of the jitted functions.

    ``attention_impl``: "xla" (the exact reference: a boolean (B, T, S) mask and the score tensor), "flash"
    (pure JAX, blockwise online softmax with a recomputing backward: O(T·block) memory, every backend),
    "splash" (TPU Pallas splash attention under ``shard_map``), "pallas_gpu" (the Triton Pallas ``mha``), "auto".
    ``moe_impl``: "block" (sorted rows padded to blocks, the XLA:CPU path), "ragged_dot" (``jax.lax.ragged_dot``),
    "megablox" (TPU Pallas ``gmm``), "auto". ``loss_chunk``: rows of logits computed at a time by the loss
    (0 = all of them, the reference), or "auto". ``interpret`` runs the Pallas kernels in interpret mode on any
    backend: for tests, never chosen by "auto". The Mamba scan is ``ModelConfig.ssm_scan`` (its "auto" is
    resolved the same way, in ``layers/mamba.py``).
    """

    attention_impl: str = "xla"
    moe_impl: str = "block"
    loss_chunk: int | str = 0
    interpret: bool = False
    platform: str | None = None  # set by ``resolve``: the backend the choices were made for

    def __post_init__(self) -> None:
        _choose("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _choose("moe_impl", self.moe_impl, MOE_IMPLS)
        chunk = self.loss_chunk
        if not (chunk == "auto" or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0)):
            raise ConfigError(f"Kernels.loss_chunk = {chunk!r} is invalid: give a number of rows >= 1, 0 for the "
                              f"whole logits at once, or 'auto'")
        if self.platform not in (None, "any", "cpu", "gpu", "tpu"):
            raise ConfigError(f"Kernels.platform = {self.platform!r} is invalid: valid values are cpu, gpu, tpu")
        if not isinstance(self.interpret, bool):
            raise ConfigError(f"Kernels.interpret = {self.interpret!r} is invalid: it must be true or false")

    def resolve(self, platform: str | None = None) -> "Kernels":
        """Concrete choices for ``platform`` ("cpu", "gpu", "tpu"; default: the default backend's).

        "auto": attention splash on TPU, pallas_gpu on GPU; on the CPU it stays "auto" and is chosen per window
        length by ``attention_path`` (xla up to ``CPU_FLASH_FROM`` positions, flash from there:
        experiments/bench_attention.py); MoE megablox on TPU, ragged_dot on GPU, block on
        the CPU (XLA:CPU lowers ragged_dot to a masked dense product); the loss chunked on accelerators (sized
        per call by ``kernels.loss.choose_chunk``), whole on the CPU. A kernel asked for by name on a backend
        that cannot run it is refused (interpret mode is for tests, not a silent fallback).
        """
        platform = backend_platform(platform)
        if self.platform not in (None, "any") and self.platform != platform:
            return dataclasses.replace(self, platform=None).resolve(platform)
        attn = self.attention_impl
        if attn == "auto":
            attn = {"tpu": "splash", "gpu": "pallas_gpu"}.get(platform, "auto")
        moe = self.moe_impl
        if moe == "auto":
            moe = {"tpu": "megablox", "gpu": "ragged_dot"}.get(platform, "block")
        chunk = self.loss_chunk
        if chunk == "auto" and platform == "cpu":
            chunk = 0
        for name, impl, valid in (("attention_impl", attn, ATTENTION_IMPLS), ("moe_impl", moe, MOE_IMPLS)):
            need = KERNEL_BACKEND.get(impl)
            if need and need != platform and not self.interpret:
                here = [v for v in valid if KERNEL_BACKEND.get(v) in (None, platform)]
                raise ConfigError(f"{name} = {impl!r} is a {need.upper()} kernel and this backend is {platform!r}: "
                                  f"valid here are {here}")
        return dataclasses.replace(self, attention_impl=attn, moe_impl=moe, loss_chunk=chunk, platform=platform)


REFERENCE = Kernels(platform="any")  # the exact paths on every backend: xla attention, block MoE, whole logits
# On XLA:CPU the reference attention is faster for short windows (one 128-block tile is the whole score matrix)
# and flash from 512 positions on (0.84x of xla's time at T = 512, 0.27-0.38x at 2,048-8,192; bench_attention).
CPU_FLASH_FROM = 512


def attention_path(kernels: Kernels, length: int, window: int | None = None, *, cap: float | None = None,
                   growing_window: bool = False) -> str:
    """The attention implementation a resolved ``kernels`` uses for a window of ``length`` positions. A feature a
    kernel cannot honour routes the layer to "flash", which honours all of them (never to a kernel that would
    ignore it): a sliding ``window`` or a soft ``cap`` of the scores — the Triton ``mha`` of "pallas_gpu" has
    neither; a ``growing_window`` (a traced window size, the window warmup of training) — splash builds its mask
    from static sizes. Splash honours a static window and the cap (its ``attn_logits_soft_cap``)."""
    impl = kernels.attention_impl
    if impl == "pallas_gpu" and (window is not None or cap is not None):
        return "flash"
    if impl == "splash" and growing_window:
        return "flash"
    if impl != "auto":
        return impl
    return "flash" if length >= CPU_FLASH_FROM else "xla"
