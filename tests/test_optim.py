"""M20 §12: global clipping + AdamW with decay groups, against the seed and an independent NumPy AdamW."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.flatten_util import ravel_pytree

from mlx_llm import examples, forward, init_params
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.loss import masked_cross_entropy
from mlx_llm.train.masks import decay_mask
from mlx_llm.train.optim import make_optimizer, warmup_cosine

from helpers import tiny_cfg


def _setup(tie=False):
    cfg, params, tokens, targets = examples.running_example(tie_embeddings=tie)
    params = jax.tree.map(jnp.asarray, params)
    mask = jnp.ones((1, 3))

    @jax.jit
    def loss_fn(p):
        return masked_cross_entropy(forward(p, tokens, cfg), jnp.asarray(targets), mask)

    return params, loss_fn


@pytest.mark.slow
def test_first_step_of_m20():
    params, loss_fn = _setup()
    grads = jax.grad(loss_fn)(params)
    assert round(float(optax.tree.norm(grads)), 9) == 0.587186334  # clipping inactive at c = 1
    opt = make_optimizer(0.01)
    updates, _ = opt.update(grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    assert round(float(loss_fn(params)), 9) == 1.109373924
    assert round(float(loss_fn(new)), 9) == 1.084831548  # M20 §12


def test_decay_mask_covers_exactly_the_matrices():
    params, _ = _setup()
    mask = traverse_util.flatten_dict(decay_mask(params))
    sizes = traverse_util.flatten_dict(params)
    decayed = sum(sizes[k].size for k, m in mask.items() if m)
    assert (decayed, sum(a.size for a in sizes.values()) - decayed) == (44, 6)
    assert {k[-1] for k, m in mask.items() if not m} == {"attn_norm", "ffn_norm", "final_norm"}


def test_decay_mask_for_every_layer_kind_lora_and_the_reward_head():
    """M20 §12 decays the weight matrices only: in a stack of every layer kind (attention, Mamba, SwiGLU, MoE
    with shared experts), the undecayed leaves are exactly the norm gains, Mamba's conv_b / dt_bias / A_log / D
    and the routing offsets; LoRA adapters decay like the matrix they adapt; the reward head decays."""
    cfg = tiny_cfg(n_layers=4, mixer_pattern=("mamba", "attn"), ffn_pattern=("moe", "swiglu", "none", "moe"),
                   n_experts=4, moe_top_k=2, moe_d_ff=8, n_shared_experts=1)
    params = init_params(cfg, jax.random.key(0))
    flat = traverse_util.flatten_dict({"model": {**params, "blocks": dict(enumerate(params["blocks"]))},
                                       "reward_head": jnp.zeros(cfg.d_model)})
    mask = traverse_util.flatten_dict(decay_mask(traverse_util.unflatten_dict(flat)))
    kept = {k[-1] for k, m in mask.items() if not m}
    assert kept == {"attn_norm", "ffn_norm", "ssm_norm", "final_norm", "conv_b", "dt_bias", "A_log", "D",
                    "router_offset"}
    decayed = {k[-1] for k, m in mask.items() if m}
    assert {"embed", "unembed", "wq", "wo", "in_x", "conv_w", "out_proj", "router", "expert_gate", "shared_down",
            "w_down", "reward_head"} <= decayed
    adapters = {"blocks": {"wq": {"A": jnp.ones((2, 3, 1)), "B": jnp.ones((2, 1, 3))}}}
    assert jax.tree.leaves(decay_mask(adapters)) == [True, True]
    with pytest.raises(ConfigError, match=r"'blocks/mystery' is not declared in layers/layout.py"):
        decay_mask({"blocks": {"mystery": jnp.ones(3)}})


def test_weight_decay_leaves_mamba_vectors_untouched():
    """With a zero gradient, one AdamW step shrinks a decayed matrix by exactly (1 − η λ) and leaves D and
    A_log as they were (M20 §12's update with g = 0)."""
    params = {"blocks": {"in_x": jnp.full((2, 3), 2.0), "D": jnp.full((3,), 2.0), "A_log": jnp.full((3, 2), 2.0)}}
    opt = make_optimizer(0.1, weight_decay=0.5, clip_norm=None)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    after = optax.apply_updates(params, updates)
    np.testing.assert_allclose(after["blocks"]["in_x"], 2.0 * (1 - 0.1 * 0.5), rtol=1e-12)
    assert np.array_equal(after["blocks"]["D"], params["blocks"]["D"])
    assert np.array_equal(after["blocks"]["A_log"], params["blocks"]["A_log"])


def _numpy_schedule(s, peak, warmup, total, floor):
    if s < warmup:
        return peak * (s + 1) / warmup
    progress = min((s - warmup) / (total - warmup), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _numpy_adamw(theta, grad_fn, decay_vec, steps, lr_fn, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, clip=1.0):
    """M20 §12 written out: clip by the global norm, moments, bias correction, decoupled decay."""
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    clipped = []
    for s in range(1, steps + 1):
        g = grad_fn(theta)
        norm = np.sqrt(np.sum(g * g))
        factor = 1.0 if norm == 0 else min(1.0, clip / norm)
        clipped.append(factor < 1.0)
        g = g * factor
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** s), v / (1 - b2 ** s)
        eta = lr_fn(s - 1)
        theta = (1 - eta * wd * decay_vec) * theta - eta * m_hat / (np.sqrt(v_hat) + eps)
    return theta, clipped


@pytest.mark.parametrize("tie", [False, True])
def test_steps_with_clipping_and_schedule_match_numpy(tie):
    params, loss_fn = _setup(tie)
    flat, unravel = ravel_pytree(params)
    decay_vec, _ = ravel_pytree(jax.tree.map(lambda p, m: jnp.full(p.shape, float(m)), params, decay_mask(params)))
    grad_fn = jax.jit(jax.grad(loss_fn))
    peak, warmup, total, floor, clip, steps = 0.05, 2, 6, 0.1, 0.2, 7
    schedule = warmup_cosine(peak, warmup, total, floor)
    opt = make_optimizer(schedule, clip_norm=clip)
    state = opt.init(params)
    p = params
    for _ in range(steps):
        updates, state = opt.update(grad_fn(p), state, p)
        p = optax.apply_updates(p, updates)
    ref, clipped = _numpy_adamw(np.asarray(flat), lambda th: np.asarray(ravel_pytree(grad_fn(unravel(th)))[0]),
                                np.asarray(decay_vec), steps, lambda s: _numpy_schedule(s, peak, warmup, total, floor),
                                clip=clip)
    assert all(clipped)  # the clip rule was active on every step
    np.testing.assert_allclose(np.asarray(ravel_pytree(p)[0]), ref, rtol=0, atol=1e-12)
    assert float(loss_fn(p)) < float(loss_fn(params))


def test_warmup_cosine_values():
    sched = warmup_cosine(1.0, 4, 12, 0.1)
    values = [float(sched(s)) for s in range(14)]
    np.testing.assert_allclose(values[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-15)
    np.testing.assert_allclose(values[8], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rtol=1e-15)
    np.testing.assert_allclose(values[12:], [0.1, 0.1], rtol=1e-15)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))


def test_zero_gradient_is_not_clipped_to_nan():
    params, _ = _setup()
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = make_optimizer(0.01, weight_decay=0.0)
    updates, _ = opt.update(zeros, opt.init(params), params)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize(
    "call, message",
    [(lambda: make_optimizer(0.01, clip_norm=0.0), r"clip_norm = 0.0 is invalid: it must be > 0 or None"),
     (lambda: make_optimizer(0.01, b2=1.0), r"b2 = 1.0 is invalid"),
     (lambda: make_optimizer(0.01, weight_decay=-0.1), r"weight_decay = -0.1 is invalid"),
     (lambda: warmup_cosine(1.0, 20, 10), r"warmup_steps = 20 must be an integer in \[0, total_steps = 10\]"),
     (lambda: warmup_cosine(0.0, 1, 10), r"peak = 0.0 must be a finite number > 0"),
     (lambda: warmup_cosine(1.0, 1, 10, 1.5), r"final_fraction = 1.5 must be in \[0, 1\]")],
)
def test_bad_optimizer_settings(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
