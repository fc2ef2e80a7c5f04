"""The attention dispatch (kernels/attention.py): every implementation equals the "xla" reference in values and
in the gradients of q, k and v; the whole model's loss and gradients are the same under each; bad settings are
refused by name. The Pallas kernels run in interpret mode on the CPU (shapes tiny: interpret mode is slow)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.kernels import Kernels, attention_path
from mlx_llm.kernels.attention import attention
from mlx_llm.model import init_params
from mlx_llm.train.step import summed_loss_and_aux

IMPLS = ("flash", "splash", "pallas_gpu")
F32_RTOL = 2e-5  # relative to the largest entry of the reference
BF16_RTOL = 3e-2


def packed_segments(rng, b, t, pad_row=False):
    """Sorted segment ids of documents of random lengths; with ``pad_row`` the last row is one padding segment."""
    seg = np.sort(rng.integers(0, 4, (b, t)), axis=1)
    if pad_row:
        seg[-1] = 0
    return jnp.asarray(seg, jnp.int32)


def qkv(key, b, t, h, g, k, dtype):
    ks = jax.random.split(key, 4)
    return tuple(jax.random.normal(kk, shape, jnp.float32).astype(dtype)
                 for kk, shape in zip(ks, ((b, t, h, k), (b, t, g, k), (b, t, g, k), (b, t, h, k))))


def value_and_grads(impl, q, k, v, ct, seg, causal):
    kernels = Kernels(attention_impl=impl, interpret=impl in ("splash", "pallas_gpu"), platform="cpu")

    def f(q, k, v):
        return jnp.sum(attention(q, k, v, seg, causal=causal, kernels=kernels).astype(jnp.float32) * ct)

    with x64_for(impl):
        out = attention(q, k, v, seg, causal=causal, kernels=kernels)
        return out, jax.grad(f, (0, 1, 2))(q, k, v)


def x64_for(impl):
    """The Triton kernel's index arithmetic mixes int32 and int64 under x64 (a jax limitation): on GPUs runs
    are float32/bf16 anyway, so its tests trace with x64 off."""
    return jax.enable_x64(impl != "pallas_gpu")


def close(a, b):
    """Largest absolute difference relative to the largest entry of the reference ``b``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio", (1, 2, 4))
@pytest.mark.parametrize("causal", (True, False))
def test_equals_xla_in_values_and_grads(impl, ratio, causal):
    rng = np.random.default_rng(ratio + 10 * causal)
    b, t, g, k = 2, 37, 1 if ratio == 4 else 2, 16  # 37: not a multiple of any block
    q, kk, v, ct = qkv(jax.random.key(ratio), b, t, g * ratio, g, k, jnp.float32)
    seg = packed_segments(rng, b, t, pad_row=True)
    ref, ref_g = value_and_grads("xla", q, kk, v, ct, seg, causal)
    out, grads = value_and_grads(impl, q, kk, v, ct, seg, causal)
    assert close(out, ref) < F32_RTOL
    for got, want in zip(grads, ref_g):
        assert close(got, want) < F32_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_within_stated_bound_and_no_segments(impl):
    q, k, v, ct = qkv(jax.random.key(7), 1, 48, 4, 2, 16, jnp.float32)
    ref, ref_g = value_and_grads("xla", q, k, v, ct, None, True)
    out, grads = value_and_grads(impl, *(a.astype(jnp.bfloat16) for a in (q, k, v)), ct, None, True)
    assert out.dtype == jnp.bfloat16
    assert close(out, ref) < BF16_RTOL
    for got, want in zip(grads, ref_g):
        assert close(got, want) < BF16_RTOL


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, d_ff=48, max_seq_len=64)


def model_batch(rng, b=2, t=24):
    seg = packed_segments(rng, b, t)
    pos = np.zeros((b, t), np.int32)
    for r in range(b):
        for i in range(1, t):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    toks = rng.integers(0, CFG.vocab_size, (b, t + 1))
    return {"tokens": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
            "mask": jnp.ones((b, t), jnp.float32), "segment_ids": seg, "positions": jnp.asarray(pos)}


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", (True, False))
def test_whole_model_loss_and_grads_equal_xla(impl, causal):
    cfg = dataclasses.replace(CFG, causal=causal)
    params = init_params(cfg, jax.random.key(0))
    batch = model_batch(np.random.default_rng(1))

    def loss(p, kernels):
        total, (n, _) = summed_loss_and_aux(p, batch, cfg, jnp.float32, kernels=kernels)
        return total / n

    ref = jax.value_and_grad(loss)(params, Kernels(platform="cpu"))
    with x64_for(impl):
        got = jax.value_and_grad(loss)(params, Kernels(attention_impl=impl, interpret=True, platform="cpu"))
    assert abs(float(got[0]) - float(ref[0])) < 1e-5 * abs(float(ref[0]))
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        assert close(a, b) < 1e-4


def test_unknown_and_wrong_backend_kernels_are_refused():
    with pytest.raises(ConfigError, match=r"attention_impl = 'spalsh' is invalid: valid values are \['xla'"):
        Kernels(attention_impl="spalsh")
    with pytest.raises(ConfigError, match="moe_impl = 'grouped' is invalid"):
        TrainConfig(moe_impl="grouped")
    with pytest.raises(ConfigError, match="loss_chunk = -3 is invalid"):
        Kernels(loss_chunk=-3)
    for impl in ("splash", "pallas_gpu"):
        with pytest.raises(ConfigError, match=f"attention_impl = '{impl}' is a .PU kernel and this backend is 'cpu'"):
            Kernels(attention_impl=impl).resolve("cpu")
    with pytest.raises(ConfigError, match="moe_impl = 'megablox' is a TPU kernel"):
        Kernels(moe_impl="megablox").resolve("gpu")
    assert Kernels(attention_impl="splash", interpret=True).resolve("cpu").attention_impl == "splash"


@pytest.mark.slow
def test_auto_resolves_per_backend():
    auto = TrainConfig().kernels()
    assert [auto.resolve(p).attention_impl for p in ("cpu", "gpu", "tpu")] == ["auto", "pallas_gpu", "splash"]
    cpu = auto.resolve("cpu")
    assert [attention_path(cpu, t) for t in (128, 511, 512, 4096)] == ["xla", "xla", "flash", "flash"]
    assert attention_path(auto.resolve("tpu"), 128) == "splash"
    assert [auto.resolve(p).moe_impl for p in ("cpu", "gpu", "tpu")] == ["block", "ragged_dot", "megablox"]
    assert [auto.resolve(p).loss_chunk for p in ("cpu", "gpu", "tpu")] == [0, "auto", "auto"]
    assert Kernels.from_dict(auto.resolve("tpu").to_dict()) == auto.resolve("tpu")
