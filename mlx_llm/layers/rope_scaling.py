"""RoPE scaling: the inverse frequencies ω (d_h/2,) and attention factor of each ``ModelConfig.rope_scaling``.

Each type reproduces transformers' ``ROPE_INIT_FUNCTIONS`` entry of the same name (tests/test_rope_scaling.py
compares them), written in jnp so the tables come out in the dtype asked for (float64 in the tests):

* "none": ω_i = base^(−2i/d_h), attention factor 1.
* "linear": position interpolation (Chen et al. 2023); ω unchanged here, the caller multiplies every position by
  ``rope_scale`` (``position_scale``), which equals transformers' division of ω by factor = 1/rope_scale.
* "llama3": the frequency-band rule of Llama 3.1 (Meta 2024). With T₀ = ``rope_original_len`` and wavelength
  λ_i = 2π/ω_i: bands with λ_i > T₀/low_freq_factor are interpolated (ω_i/factor), bands with
  λ_i < T₀/high_freq_factor are kept, and between them ω_i blends linearly in T₀/λ_i from one to the other.
* "yarn": Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models". NTK-by-parts:
  dimension index r(n) = d_h·ln(T₀/(2πn))/(2 ln base) is the dimension that turns n times over T₀; a ramp from
  r(beta_fast) to r(beta_slow) (floored/ceiled when ``rope_truncate``, clipped to [0, d_h − 1]) blends from the
  original ω (fast dimensions) to ω/factor (slow ones). The attention temperature is 0.1·ln(s) + 1 for s > 1
  (1 otherwise), or the ratio of its ``rope_mscale`` and ``rope_mscale_all_dim`` forms when both are set, or
  ``rope_attention_factor`` when given.
* "dynamic": dynamic NTK scaling (bloc97; transformers' "dynamic"). For a call whose longest position is T − 1
  (seq_len T), when T > T₀ the base becomes base·((factor·T/T₀) − (factor − 1))^(d_h/(d_h − 2)); otherwise ω is
  unchanged.

How "dynamic" relates to transformers: its rotary module keeps a cache, and on every forward takes
T = max(position_ids) + 1, recomputes ω when T grows past the largest T seen so far, and goes back to the
original ω when T drops below T₀ after having grown past it. ``rope_tables`` is a pure function of T instead.
Within one generate call, whose positions only grow, the two agree at every step (prefill T, then T + 1, …);
they differ only when a later call reuses transformers' cache with a T between T₀ and an earlier, larger T.
As in transformers, keys cached by earlier decoding steps keep the rotation of the step that wrote them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mlx_llm.errors import ConfigError
from mlx_llm.ops import _accum_dtype, rope_frequencies, rope_rotate


def position_scale(cfg) -> float:
    """The factor every position is multiplied by before rotation: ``rope_scale`` (1 unless "linear")."""
    return cfg.rope_scale


def yarn_attention_factor(cfg) -> float:
    """YaRN's attention temperature for ``cfg`` (a Python float; see the module docstring)."""
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)

    def temperature(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        s = cfg.rope_factor
        return float(temperature(s, cfg.rope_mscale) / temperature(s, cfg.rope_mscale_all_dim))
    return temperature(cfg.rope_factor)


def yarn_ramp_bounds(cfg) -> tuple[float, float]:
    """(low, high): the dimension indices between which YaRN's ramp runs (Python floats)."""
    d, base, t0 = cfg.d_head, cfg.rope_base, cfg.rope_original_len

    def dim_turning(n_turns: float) -> float:  # the (fractional) dimension that turns n times over T₀
        return d * math.log(t0 / (n_turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(cfg.rope_beta_fast), dim_turning(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, d - 1)


def _llama3(cfg, omega: jax.Array) -> jax.Array:
    factor, lo, hi, t0 = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_len
    wavelength = 2 * math.pi / omega
    long_band = wavelength > t0 / lo  # low frequencies: fully interpolated
    short_band = wavelength < t0 / hi  # high frequencies: kept
    banded = jnp.where(long_band, omega / factor, omega)
    blend = (t0 / wavelength - lo) / (hi - lo)
    smoothed = (1 - blend) * banded / factor + blend * banded
    return jnp.where(~short_band & ~long_band, smoothed, banded)


def _yarn(cfg, omega: jax.Array) -> jax.Array:
    low, high = yarn_ramp_bounds(cfg)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = jnp.clip((jnp.arange(cfg.d_head // 2, dtype=omega.dtype) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original ω (extrapolation), 0: ω/factor (interpolation)
    return (omega / cfg.rope_factor) * (1 - keep) + omega * keep


def _dynamic(cfg, seq_len, dtype) -> jax.Array:
    d, t0, factor = cfg.d_head, cfg.rope_original_len, cfg.rope_factor  # d > 2: ModelConfig._check_rope
    plain = rope_frequencies(d, cfg.rope_base, dtype)
    if seq_len is None:
        return plain
    t = jnp.maximum(jnp.asarray(seq_len).astype(dtype), t0)  # ≥ T₀, so the power below never sees a negative
    base = cfg.rope_base * ((factor * t / t0) - (factor - 1)) ** (d / (d - 2))
    return jnp.where(t > t0, rope_frequencies(d, base, dtype), plain)


def rope_tables(cfg, seq_len=None, dtype=jnp.float32) -> tuple[jax.Array, float]:
    """(ω (d_h/2,) in ``dtype``, attention factor) of ``cfg.rope_scaling``: the inverse frequencies and the
    scalar transformers multiplies cos and sin by.

    ``seq_len`` matters only for "dynamic": the longest position of the call + 1 (a Python int or a traced jnp
    scalar; None: no scaling, as at T ≤ T₀). The attention factor is a Python float (1.0 except for "yarn").
    "linear" returns the plain ω: apply ``position_scale(cfg)`` to the positions.
    """
    omega = rope_frequencies(cfg.d_head, cfg.rope_base, dtype)
    kind = cfg.rope_scaling
    if kind in ("none", "linear"):
        return omega, 1.0
    if kind == "llama3":
        return _llama3(cfg, omega), 1.0
    if kind == "yarn":
        return _yarn(cfg, omega), yarn_attention_factor(cfg)
    if kind == "dynamic":
        return _dynamic(cfg, seq_len, dtype), 1.0
    raise ConfigError(f"rope_scaling = {kind!r} is not a known RoPE scaling")


def rope_for(positions_BT: jax.Array, cfg, *xs_BTHK: jax.Array, local: bool = False) -> tuple[jax.Array, ...]:
    """RoPE of ``cfg`` applied to each of ``xs_BTHK`` (q and k) at ``positions_BT``, from one table.

    For "dynamic", seq_len = max(positions) + 1 over the whole batch, as transformers takes it. A ``local``
    (sliding-window) layer of a config with ``rope_local_base`` rotates plainly at that base, ω_i =
    base_local^(−2i/d_h), with no scaling (Gemma 3: local layers at 10⁴, global ones at 10⁶ and their scaling).
    """
    dtype = _accum_dtype(xs_BTHK[0].dtype)
    if local and getattr(cfg, "rope_local_base", None) is not None:
        omega = rope_frequencies(cfg.d_head, cfg.rope_local_base, dtype)
        return tuple(rope_rotate(x, positions_BT, omega) for x in xs_BTHK)
    seq_len = jnp.max(positions_BT) + 1 if cfg.rope_scaling == "dynamic" else None
    omega, factor = rope_tables(cfg, seq_len, dtype)
    return tuple(rope_rotate(x, positions_BT, omega, position_scale=position_scale(cfg), attention_factor=factor)
                 for x in xs_BTHK)
