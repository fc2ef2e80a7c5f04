"""RoPE scaling (layers/rope_scaling.py) against transformers' ROPE_INIT_FUNCTIONS and a float64 numpy transcription.

Tolerances: transformers builds every inverse-frequency table in float32 (its ``torch.float`` is float32 whatever
torch's default dtype), so our float64 tables are compared with it at float32 rounding, |Δω| ≤ 1e-6·(size of the
rounded terms): |ω| itself, except for YaRN, whose blend of ω and ω/factor is rounded at the scale of the plain ω
(up to factor times the result). They are compared with an independent float64 numpy transcription of each
formula (below) at rtol 1e-12. Attention factors are Python floats on both sides and compared to 1e-15.
"""

import functools
import itertools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_cfg
from mlx_llm.errors import ConfigError
from mlx_llm.layers.rope_scaling import position_scale, rope_for, rope_tables
from mlx_llm.ops import rope, rope_frequencies, rope_rotate

F32_RTOL, F64_RTOL = 1e-6, 1e-12


@functools.cache
def hf():
    """torch and transformers (the ``hf`` extra), imported when a test compares with them: the file collects, and
    its own tests run, without them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama import modeling_llama

    return types.SimpleNamespace(torch=torch, transformers=transformers, ROPE_INIT_FUNCTIONS=ROPE_INIT_FUNCTIONS,
                                 LlamaRotaryEmbedding=modeling_llama.LlamaRotaryEmbedding,
                                 apply_rotary_pos_emb=modeling_llama.apply_rotary_pos_emb)


# ----- the formulas, transcribed independently in float64 numpy --------------------------------------------------
def np_omega(d, base):
    return base ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def np_llama3(d, base, factor, lo, hi, t0):
    w = np_omega(d, base)
    lam = 2 * np.pi / w
    s = (t0 / lam - lo) / (hi - lo)  # 0 at λ = T₀/lo, 1 at λ = T₀/hi
    middle = ((1 - s) / factor + s) * w
    return np.where(lam > t0 / lo, w / factor, np.where(lam < t0 / hi, w, middle))


def np_yarn(d, base, factor, t0, beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attention_factor):
    def dim_of(turns):
        return d * np.log(t0 / (2 * np.pi * turns)) / (2 * np.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, d - 1.0)
    high = high + 0.001 if high == low else high
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    w = np_omega(d, base)
    omega = w * (1 - ramp) + (w / factor) * ramp

    def temp(m):
        return 1.0 if factor <= 1 else 0.1 * m * np.log(factor) + 1.0
    if attention_factor is None:
        attention_factor = temp(mscale) / temp(mscale_all_dim) if mscale and mscale_all_dim else temp(1.0)
    return omega, attention_factor


def np_dynamic(d, base, factor, t0, seq_len):
    if seq_len > t0:
        base = base * (factor * seq_len / t0 - factor + 1) ** (d / (d - 2))
    return np_omega(d, base)


# ----- building both sides -----------------------------------------------------------------------------------
def ours(d, max_seq_len=8192, **rope):
    return tiny_cfg(n_heads=2, n_kv_heads=1, d_head=d, max_seq_len=max_seq_len, **rope)


def hf_config(d, max_positions, **params):
    params = {"rope_theta": params.pop("rope_theta", 10000.0), **params}
    return hf().transformers.LlamaConfig(hidden_size=2 * d, num_attention_heads=2, num_key_value_heads=1, head_dim=d,
                                    max_position_embeddings=max_positions, rope_parameters=params)


def hf_tables(kind, config, seq_len=None):
    omega, factor = hf().ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    assert omega.dtype == hf().torch.float32  # the reason for the float32 tolerance
    return omega.double().numpy(), factor


def close_to_f32(omega, hf_omega, scale, rtol=F32_RTOL):
    """|ω − ω_hf| ≤ rtol·scale elementwise (scale: the size of the float32 terms transformers rounded)."""
    err = np.abs(np.asarray(omega, np.float64) - hf_omega) / scale
    assert err.max() <= rtol, f"max error {err.max():.3g} (of the float32 scale) at index {err.argmax()}"


def check(cfg, hf_omega, hf_factor, np_omega_, np_factor, seq_len=None, f32_scale=None):
    """Our float64 table against transformers (float32 rounding of terms of size ``f32_scale``, default |ω_hf|)
    and the numpy transcription (1e-12); the attention factors to 1e-15; our float32 table against transformers."""
    scale = np.abs(hf_omega) if f32_scale is None else f32_scale
    omega, factor = rope_tables(cfg, seq_len, jnp.float64)
    assert omega.dtype == jnp.float64 and omega.shape == (cfg.d_head // 2,)
    close_to_f32(omega, hf_omega, scale)
    np.testing.assert_allclose(omega, np_omega_, rtol=F64_RTOL, atol=0)
    assert isinstance(factor, float)
    assert factor == pytest.approx(hf_factor, rel=1e-15) and factor == pytest.approx(np_factor, rel=1e-15)
    omega32, factor32 = rope_tables(cfg, seq_len, jnp.float32)
    assert omega32.dtype == jnp.float32 and factor32 == factor
    close_to_f32(omega32, hf_omega, scale, rtol=2 * F32_RTOL)


# ----- the tables --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("d,base", [(64, 10000.0), (128, 500000.0), (128, 1e6)])
def test_none_is_plain_rope(d, base):
    cfg = ours(d, rope_base=base)
    hf_omega = hf().LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config(d, 4096, rope_theta=base))
    check(cfg, hf_omega[0].double().numpy(), hf_omega[1], np_omega(d, base), 1.0)
    assert position_scale(cfg) == 1.0
    np.testing.assert_array_equal(rope_tables(cfg)[0], rope_frequencies(d, base))


@pytest.mark.parametrize("d,scale", [(64, 0.25), (128, 0.5), (64, 0.125)])
def test_linear_is_a_position_multiplier(d, scale):
    """transformers divides ω by factor = 1/rope_scale; we keep ω and multiply positions: the same angles."""
    cfg = ours(d, rope_scale=scale)
    assert cfg.rope_scaling == "linear" and position_scale(cfg) == scale
    omega, factor = rope_tables(cfg, None, jnp.float64)
    assert factor == 1.0
    np.testing.assert_array_equal(omega, rope_frequencies(d, 10000.0, jnp.float64))
    hf_omega, hf_factor = hf_tables("linear", hf_config(d, 4096, rope_type="linear", factor=1 / scale))
    np.testing.assert_allclose(np.asarray(omega) * position_scale(cfg), hf_omega, rtol=F32_RTOL, atol=0)
    assert hf_factor == 1.0


LLAMA3 = list(itertools.product([64, 128], [10000.0, 500000.0], [2.0, 8.0, 32.0], [1024, 8192],
                                [(1.0, 4.0), (2.0, 8.0), (0.5, 3.0)]))


@pytest.mark.parametrize("d,base,factor,t0,bands", LLAMA3)
def test_llama3(d, base, factor, t0, bands):
    lo, hi = bands
    cfg = ours(d, rope_base=base, rope_scaling="llama3", rope_factor=factor, rope_original_max_len=t0,
               rope_low_freq_factor=lo, rope_high_freq_factor=hi)
    hf = hf_tables("llama3", hf_config(d, int(factor * t0), rope_type="llama3", rope_theta=base, factor=factor,
                                       original_max_position_embeddings=t0, low_freq_factor=lo, high_freq_factor=hi))
    check(cfg, *hf, np_llama3(d, base, factor, lo, hi, t0), 1.0)


def test_llama3_bands_are_all_used():
    """Llama 3.1's own parameters leave high-frequency bands unchanged, divide low ones by 8, blend between."""
    cfg = ours(128, rope_base=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192)
    ratio = np.asarray(rope_tables(cfg, None, jnp.float64)[0] / rope_frequencies(128, 500000.0, jnp.float64))
    assert ratio[0] == 1.0 and ratio[-1] == 1 / 8
    assert np.any((ratio < 1) & (ratio > 1 / 8)) and np.all(np.diff(ratio) <= 0)


YARN_CASES = [
    # d, base, factor, t0, beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attention_factor
    *[(d, 10000.0, s, t0, 32.0, 1.0, trunc, None, None, None)
      for d in (64, 128) for s in (1.0, 2.0, 4.0, 40.0) for t0 in (2048, 4096) for trunc in (True, False)],
    *[(64, 10000.0, 4.0, 2048, bf, bs, trunc, None, None, None)
      for bf, bs in ((16.0, 2.0), (64.0, 0.5), (8.0, 8.0)) for trunc in (True, False)],
    (128, 1e6, 4.0, 32768, 32.0, 1.0, True, None, None, None),  # Qwen2.5-style
    # ramp ends clipped: high past d_h/2 (clipped at d_h − 1, not d_h/2 − 1), low below 0
    *[(64, base, 4.0, t0, 32.0, bs, trunc, None, None, None)
      for base, t0, bs in ((10000.0, 131072, 1.0), (500.0, 4096, 0.5), (10000.0, 128, 1.0)) for trunc in (True, False)],
    (128, 10000.0, 40.0, 4096, 32.0, 1.0, True, 1.0, 1.0, None),  # DeepSeek-V3-style: mscale = mscale_all_dim
    (128, 10000.0, 40.0, 4096, 32.0, 1.0, True, 0.707, 1.0, None),
    (64, 10000.0, 8.0, 2048, 32.0, 1.0, True, 1.0, 0.5, None),
    (64, 10000.0, 8.0, 2048, 32.0, 1.0, True, 2.0, None, None),  # mscale alone: ignored
    (64, 10000.0, 8.0, 2048, 32.0, 1.0, False, None, None, 0.9),  # explicit attention_factor wins
    (64, 10000.0, 8.0, 2048, 32.0, 1.0, True, 1.0, 0.5, 1.25),
]


@pytest.mark.parametrize("d,base,factor,t0,beta_fast,beta_slow,truncate,mscale,mscale_all_dim,attn", YARN_CASES)
def test_yarn(d, base, factor, t0, beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attn):
    cfg = ours(d, rope_base=base, rope_scaling="yarn", rope_factor=factor, rope_original_max_len=t0,
               rope_beta_fast=beta_fast, rope_beta_slow=beta_slow, rope_truncate=truncate, rope_mscale=mscale,
               rope_mscale_all_dim=mscale_all_dim, rope_attention_factor=attn)
    optional = {k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim),
                                  ("attention_factor", attn)) if v is not None}
    hf = hf_tables("yarn", hf_config(d, int(factor * t0), rope_type="yarn", rope_theta=base, factor=factor,
                                     original_max_position_embeddings=t0, beta_fast=beta_fast, beta_slow=beta_slow,
                                     truncate=truncate, **optional))
    # the blend ω·(1 − r) + (ω/s)·r, with a float32 ramp r, is rounded at the scale of ω, not of the (up to s
    # times smaller) result: the float32 comparison is relative to the plain ω
    check(cfg, *hf, *np_yarn(d, base, factor, t0, beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attn),
          f32_scale=np_omega(d, base))


def test_yarn_defaults_original_len_and_temperature():
    """rope_original_max_len unset: T₀ = max_seq_len (transformers: original = max_position_embeddings)."""
    cfg = ours(64, max_seq_len=4096, rope_scaling="yarn", rope_factor=4.0)
    hf = hf_tables("yarn", hf_config(64, 4096, rope_type="yarn", factor=4.0))
    check(cfg, *hf, *np_yarn(64, 10000.0, 4.0, 4096, 32.0, 1.0, True, None, None, None), f32_scale=np_omega(64, 1e4))
    assert rope_tables(cfg)[1] == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)


DYNAMIC = list(itertools.product([64, 128], [2.0, 4.0, 2.3], [2048, 4096], [1, 1000, "t0", "t0+1", 5000, 20000]))


@pytest.mark.parametrize("d,factor,t0,seq_len", DYNAMIC)
def test_dynamic(d, factor, t0, seq_len):
    seq_len = {"t0": t0, "t0+1": t0 + 1}.get(seq_len, seq_len)
    cfg = ours(d, max_seq_len=4 * t0, rope_scaling="dynamic", rope_factor=factor, rope_original_max_len=t0)
    config = hf_config(d, t0, rope_type="dynamic", factor=factor)  # transformers' T₀ is max_position_embeddings
    check(cfg, *hf_tables("dynamic", config, seq_len), np_dynamic(d, 10000.0, factor, t0, seq_len), 1.0, seq_len)
    # what transformers' forward passes: a tensor, max(position_ids) + 1 (its base then rounds in float32)
    omega_t, _ = hf_tables("dynamic", config, hf().torch.tensor(seq_len))
    np.testing.assert_allclose(rope_tables(cfg, jnp.asarray(seq_len), jnp.float64)[0], omega_t, rtol=2e-6, atol=0)
    scaled = not np.allclose(rope_tables(cfg, seq_len, jnp.float64)[0], np_omega(d, 10000.0), rtol=1e-9)
    assert scaled == (seq_len > t0)


# ----- the rotation ------------------------------------------------------------------------------------------
def _rope_before(x, positions, base, scale=1.0):
    """ops.rope as it was before rope_rotate existed (for the bitwise check)."""
    k = x.shape[-1]
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    angle = (positions.astype(dtype) * scale)[..., None] * rope_frequencies(k, base, dtype)
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    a, b = x.astype(dtype)[..., : k // 2], x.astype(dtype)[..., k // 2:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_rope_and_rope_for_unchanged_bitwise(dtype):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 3, 16)).astype(dtype)
    pos = jnp.array([[0, 1, 2, 3, 4, 5, 6], [100, 101, 102, 103, 5000, 5001, 5002]])
    for scale in (1.0, 0.25):
        want = _rope_before(x, pos, 10000.0, scale)
        np.testing.assert_array_equal(rope(x, pos, 10000.0, scale), want)
        np.testing.assert_array_equal(jax.jit(rope, static_argnums=(2, 3))(x, pos, 10000.0, scale),
                                      jax.jit(_rope_before, static_argnums=(2, 3))(x, pos, 10000.0, scale))
        np.testing.assert_array_equal(rope_for(pos, ours(16, rope_scale=scale), x)[0], want)


def test_attention_factor_scales_scores_by_its_square():
    q, k = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 5, 2, 32))
    pos = jnp.array([[3, 9, 40, 41, 700]])
    omega = rope_frequencies(32, 10000.0, jnp.float64)
    for a in (0.5, 1.1386, 2.0):
        qa, ka = (rope_rotate(t, pos, omega, attention_factor=a) for t in (q, k))
        q1, k1 = (rope_rotate(t, pos, omega) for t in (q, k))
        scores_a, scores_1 = jnp.einsum("bthk,bshk->bhts", qa, ka), jnp.einsum("bthk,bshk->bhts", q1, k1)
        np.testing.assert_allclose(scores_a, a * a * scores_1, rtol=1e-12, atol=1e-12)
        assert not np.allclose(scores_a, scores_1)


def test_rope_for_dynamic_traced_seq_len():
    """Under jit the call's longest position is traced: rope_for and rope_tables pick the branch with jnp.where."""
    cfg = ours(32, rope_scaling="dynamic", rope_factor=4.0, rope_original_max_len=64)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 4, 2, 32))
    jitted = jax.jit(lambda p, x: rope_for(p, cfg, x)[0])
    for top in (10, 63, 64, 200):  # seq_len = top + 1: scaled only when it exceeds T₀ = 64
        pos = jnp.array([[0, 1, 2, 3], [top - 3, top - 2, top - 1, top]])
        eager = rope_for(pos, cfg, x)[0]
        np.testing.assert_allclose(jitted(pos, x), eager, rtol=1e-13, atol=1e-13)
        omega, _ = rope_tables(cfg, top + 1, jnp.float64)
        np.testing.assert_allclose(eager, rope_rotate(x, pos, omega), rtol=1e-13, atol=1e-13)
        plain = rope(x, pos, cfg.rope_base)
        assert np.allclose(eager, plain, rtol=1e-13, atol=1e-13) == (top + 1 <= 64)
    tables = jax.jit(lambda s: rope_tables(cfg, s, jnp.float64)[0])
    for s in (1, 64, 65, 1000):
        np.testing.assert_allclose(tables(jnp.int32(s)), rope_tables(cfg, s, jnp.float64)[0], rtol=1e-13)


def _hf_rotate(config, x, positions):
    """q rotated by transformers' Llama rotary module (fresh, so its dynamic cache starts at T₀)."""
    x_t, pos_t = hf().torch.tensor(np.asarray(x)), hf().torch.tensor(np.asarray(positions))
    cos, sin = hf().LlamaRotaryEmbedding(config)(x_t, pos_t)
    return hf().apply_rotary_pos_emb(x_t, x_t, cos, sin, unsqueeze_dim=2)[0].numpy()


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "llama3"])
def test_rope_for_matches_transformers_rotation(kind):
    """End to end through transformers' rotary module (angles in float32 there: positions are kept small). For
    "dynamic" this pins seq_len to max(position_ids) + 1: seq_len off by one moves the result by ~1e-2."""
    t0, d = 64, 32
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 2, d))
    pos = jnp.array([[0, 1, 2, 3, 4], [150, 151, 152, 153, 199]])
    rope_kw = {"dynamic": {}, "yarn": {"beta_fast": 32.0, "beta_slow": 1.0},
               "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}[kind]
    if kind == "dynamic":
        config = hf_config(d, t0, rope_type="dynamic", factor=4.0)
    else:
        config = hf_config(d, 4 * t0, rope_type=kind, factor=4.0, original_max_position_embeddings=t0, **rope_kw)
    cfg = ours(d, max_seq_len=4 * t0, rope_scaling=kind, rope_factor=4.0, rope_original_max_len=t0,
               **{"rope_" + k: v for k, v in rope_kw.items()})
    got = rope_for(pos, cfg, x)[0]
    np.testing.assert_allclose(got, _hf_rotate(config, x, pos), rtol=0, atol=1e-4)
    if kind == "dynamic":
        off_by_one = rope_rotate(x, pos, rope_tables(cfg, 201, jnp.float64)[0])
        assert np.abs(np.asarray(off_by_one) - _hf_rotate(config, x, pos)).max() > 1e-3


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": "longrope"}, "rope_scaling = 'longrope' is invalid: valid types are"),
    ({"rope_scaling": "llama3", "rope_scale": 0.5}, "cannot be combined with rope_scaling = 'llama3'"),
    ({"rope_scaling": "yarn", "rope_factor": 0.5}, "the context-extension factor must be >= 1"),
    ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0}, "must exceed"),
    ({"rope_scaling": "dynamic", "rope_factor": 2.0, "d_head": 2}, "d_head must be > 2"),
    ({"rope_mscale": -1.0}, "rope_mscale = -1.0 is invalid"),
    ({"rope_original_max_len": 0}, "rope_original_max_len = 0 is invalid"),
])
def test_bad_rope_settings_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ours(fields.pop("d_head", 16), **fields)
    assert ours(16, rope_scale=0.5).rope_scaling == "linear"  # a config written before rope_scaling existed
