"""A short training run is the same, to float32 tolerance, under every execution path (DESIGN §6): attention
(flash, splash and pallas_gpu in interpret mode), the MoE grouped products (ragged_dot, megablox in interpret
mode), the chunked Mamba scan and the chunked loss, each against the reference paths (xla, block, fused, whole
logits). Three AdamW steps of the real train step (``make_train_step``) from the same start on the same batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.train.step import init_state, make_train_step, optimizer_for

DENSE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, d_ff=48,
                    max_seq_len=64)
MOE = dataclasses.replace(DENSE, ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2, moe_d_ff=32)
MAMBA = dataclasses.replace(DENSE, mixer_pattern=("mamba", "attn"), ssm_state=4)
REF = TrainConfig(batch_size=2, seq_len=24, steps=3, warmup_steps=1, lr=3e-3, attention_impl="xla",
                  moe_impl="block", loss_chunk=0)
STEPS = 3
TOL = 2e-5  # largest |Δparam| relative to the largest |param| after three steps


def batch():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 3, (2, 24)), axis=1)
    pos = np.zeros_like(seg)
    for i in range(1, 24):
        pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
    toks = rng.integers(0, DENSE.vocab_size, (2, 25))
    return {"tokens": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
            "mask": jnp.ones((2, 24), jnp.float32), "segment_ids": jnp.asarray(seg, jnp.int32),
            "positions": jnp.asarray(pos, jnp.int32)}


def train(cfg: ModelConfig, tcfg: TrainConfig):
    step = jax.jit(make_train_step(cfg, tcfg, optimizer_for(tcfg), platform="cpu"))
    state, b = init_state(cfg, tcfg, optimizer_for(tcfg)), batch()
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state.params, losses


def assert_same_run(cfg, tcfg, *, x64: bool = True):
    with jax.enable_x64(x64):  # the Triton and megablox interpreters need x64 off (a jax limitation)
        ref_params, ref_losses = train(cfg, REF)
        params, losses = train(cfg, tcfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trained
    scale = max(float(jnp.max(jnp.abs(p))) for p in jax.tree.leaves(ref_params))
    worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
    assert worst < TOL * scale


@pytest.mark.slow
@pytest.mark.parametrize("impl", ("flash", "splash", "pallas_gpu"))
def test_attention_paths_train_the_same(impl):
    tcfg = dataclasses.replace(REF, attention_impl=impl, interpret_kernels=impl != "flash")
    assert_same_run(DENSE, tcfg, x64=impl != "pallas_gpu")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ("ragged_dot", "megablox"))
def test_moe_paths_train_the_same(impl):
    tcfg = dataclasses.replace(REF, moe_impl=impl, interpret_kernels=impl == "megablox")
    assert_same_run(MOE, tcfg, x64=impl != "megablox")


@pytest.mark.slow
def test_chunked_scan_and_chunked_loss_train_the_same():
    ref_params, ref_losses = train(MAMBA, REF)
    params, losses = train(dataclasses.replace(MAMBA, ssm_scan="chunked"), dataclasses.replace(REF, loss_chunk=7))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("attention, moe", (("flash", "ragged_dot"), ("splash", "block")))
def test_generation_is_the_same_under_the_kernel_paths(attention, moe):
    """The prefill's attention runs through the kernel (self-attention over the prompt), every MoE layer through
    the grouped product; greedy tokens are identical and their log-probabilities equal to float32 tolerance."""
    from mlx_llm.decode.generate import generate
    from mlx_llm.kernels import Kernels

    params = init_state(MOE, REF, optimizer_for(REF)).params
    prompt = np.array([[1, 5, 9, 13, 2, 7, 7, 3, 11], [4, 4, 8, 0, 0, 0, 0, 0, 0]], np.int32)
    args = dict(prompt_lengths=[9, 3], pad_id=0)
    ref = generate(params, MOE, prompt, 6, **args)
    got = generate(params, MOE, prompt, 6, **args,
                   kernels=Kernels(attention_impl=attention, moe_impl=moe, interpret=True, platform="cpu"))
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logp, ref.logp, rtol=1e-5)
