"""The whole model's hand backward (mlx_llm.objectives.grads.analytic_grad) for every kind of ModelConfig, three ways
with mlx_llm.gradcheck: analytic = jax.grad to 1e-9 relative in float64, and both = central differences.

Each whole-model case compiles its functions once (the analytic gradient, and check_grads' value-and-gradient and
batched evaluations); the cases are tiny (d = 8, T = 6) so each check is a few seconds of compilation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, examples, forward, init_params
from mlx_llm import lora as lora_lib
from mlx_llm.gradcheck import ANALYTIC_VS_AUTODIFF, AUTODIFF_VS_CENTRAL, assert_trees_close, check_grads, quick_jit
from mlx_llm.kernels import Kernels
from mlx_llm.layers import attention as attention_layer
from mlx_llm.layers import layout
from mlx_llm.layers import mamba as mamba_layer
from mlx_llm.model import Context
from mlx_llm.objectives import diffusion, grads
from mlx_llm.objectives.loss import masked_cross_entropy
from mlx_llm.ops import causal_mask, window_band
from mlx_llm.train.step import summed_loss_and_aux

REL = 1e-9  # the acceptance bound: analytic against jax.grad, relative, float64
B, T = 2, 6
BASE = dict(vocab_size=7, d_model=8, max_seq_len=16, n_heads=4, n_kv_heads=2, d_head=4, d_ff=6)
MOE = dict(n_experts=4, moe_top_k=2, moe_d_ff=5)
SSM = dict(ssm_state=3, ssm_conv=3, ssm_expand=1, ssm_dt_rank=2)
CONFIGS = {
    # Mamba + MoE hybrid (sigmoid router, a shared expert, nonzero offsets), an attention layer with no FFN
    "hybrid": ModelConfig(**BASE, n_layers=2, mixer_pattern=("mamba", "attn"), ffn_pattern=("moe", "none"), **MOE,
                          n_shared_experts=1, **SSM),
    # local/global (two groups of two layers), q/k norms, Q/K/V biases, llama3 RoPE, tied embeddings, GQA
    "local_global": ModelConfig(**BASE, n_layers=4, mixer_pattern=("local", "attn"), sliding_window=2,
                                qk_norm=True, qkv_bias=True, rope_scaling="llama3", rope_factor=4.0,
                                rope_original_max_len=4, rope_base=100.0, tie_embeddings=True),
    # YaRN RoPE on a uniform stack of softmax-routed MoE layers without shared experts
    "yarn": ModelConfig(**BASE, n_layers=2, ffn_pattern=("moe",), **{**MOE, "moe_top_k": 1}, router="softmax",
                        rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=4, rope_base=100.0),
    # the other scalings: dynamic NTK (T > T₀, so it acts) and linear position interpolation
    "dynamic": ModelConfig(**BASE, n_layers=1, rope_scaling="dynamic", rope_factor=2.0, rope_original_max_len=4),
    "linear": ModelConfig(**BASE, n_layers=1, rope_scale=0.25, qkv_bias=True),
}
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # packed documents: attention and Mamba restart
POSITIONS = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])


@functools.lru_cache(maxsize=None)
def case(name: str, seed: int = 0):
    """(cfg, params, tokens, targets, mask): every float leaf moved off its initial value (norm gains ≠ 1, biases,
    offsets and LoRA-free B ≠ 0), router logits scaled ×3 so no top-k selection is near a tie."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(seed)
    params = quick_jit(lambda key: init_params(cfg, key, jnp.float64))(jax.random.key(seed))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: np.asarray(a) * (3.0 if "router" == path[-1].key else 1.0) + 0.3 * rng.standard_normal(a.shape),
        params)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    mask = np.array([[0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 0, 1]])
    return cfg, params, tokens, targets, mask


def loss_fn(params, tokens, targets, mask, cfg, **kw):
    return masked_cross_entropy(forward(params, tokens, cfg, **kw), targets, mask)


def three_way(name, **kw):
    """check_grads of the model's loss with the analytic gradient; asserts it passes and that analytic = jax.grad
    to ``REL``. Returns the report."""
    cfg, params, tokens, targets, mask = case(name)
    analytic = quick_jit(lambda p: grads.analytic_grad(p, tokens, targets, mask, cfg, **kw))
    report = check_grads(lambda p: loss_fn(p, tokens, targets, mask, cfg, **kw), params, analytic=analytic)
    report.assert_ok()
    assert report.max_rel(ANALYTIC_VS_AUTODIFF) <= REL
    assert len(report.leaves) == len(jax.tree.leaves(params))  # every leaf, both comparisons
    assert all(len(c) == 2 for c in report.leaves.values())
    return report


# ----- 1. the acceptance cases, three ways ------------------------------------------------------------------------
@pytest.mark.slow
def test_hybrid_mamba_moe_three_ways_with_packed_documents():
    report = three_way("hybrid", segment_ids_BT=SEGMENTS, positions_BT=POSITIONS)
    assert {"blocks/0/A_log", "blocks/0/conv_w", "blocks/0/dt_proj", "blocks/0/expert_up", "blocks/0/shared_down",
            "blocks/1/wq"} <= set(report.leaves)
    assert report.leaves["blocks/0/router_offset"][AUTODIFF_VS_CENTRAL].max_abs == 0.0  # routing state, not θ


@pytest.mark.slow
def test_local_global_qk_norm_qkv_bias_llama3_tied_three_ways():
    report = three_way("local_global")
    assert {"blocks/0/bq", "blocks/1/k_norm", "embed"} <= set(report.leaves) and "unembed" not in report.leaves


@pytest.mark.slow
def test_yarn_softmax_moe_three_ways():
    three_way("yarn")


@pytest.mark.slow
def test_lora_adapters_three_ways():
    """A LoRA run on the hybrid: adapters on attention (wq, wv) and Mamba (in_x, out_proj) weights, B ≠ 0."""
    cfg, base, tokens, targets, mask = case("hybrid")
    lora_cfg = lora_lib.LoRAConfig(rank=2, alpha=3.0, targets=("wq", "wv", "in_x", "out_proj"))
    adapters = lora_lib.init(base, lora_cfg, jax.random.key(1))
    rng = np.random.default_rng(2)
    adapters = jax.tree.map(lambda a: np.asarray(a, np.float64) + 0.5 * rng.standard_normal(a.shape), adapters)

    def loss(p):
        return loss_fn(lora_lib.adapted(base, p["lora"], lora_cfg), tokens, targets, mask, cfg)

    analytic = quick_jit(lambda p: {"lora": grads.analytic_lora_value_and_grad(p["lora"], base, tokens, targets,
                                                                               mask, cfg, lora_cfg)[1]})
    report = check_grads(loss, {"lora": adapters}, analytic=analytic)
    report.assert_ok()
    assert report.max_rel(ANALYTIC_VS_AUTODIFF) <= REL
    assert sorted(report.leaves) == sorted(f"lora/blocks/{j}/{t}/{m}" for j, ts in ((0, ("in_x", "out_proj")),
                                                                                      (1, ("wq", "wv")))
                                           for t in ts for m in "AB")


# ----- 2. analytic = jax.grad for the other configurations and heads ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic", "linear"])
def test_other_rope_scalings_match_jax_grad(name):
    cfg, params, tokens, targets, mask = case(name)
    both = quick_jit(lambda p: (jax.grad(loss_fn)(p, tokens, targets, mask, cfg),
                                grads.analytic_grad(p, tokens, targets, mask, cfg)))
    want, got = both(params)
    assert_trees_close(got, want, REL)


@pytest.mark.slow
def test_z_loss_and_the_chunked_loss_match_the_training_step():
    """The training step's loss per target, W·ℓ² included, through its chunked path (kernels/loss.py)."""
    cfg, params, tokens, targets, mask = case("dynamic")
    batch = {"tokens": tokens, "targets": targets, "mask": mask, "positions": None, "segment_ids": None}

    def step_loss(p):
        total, (n, _) = summed_loss_and_aux(p, batch, cfg, jnp.float64, kernels=Kernels(loss_chunk=5), z_loss=0.1)
        return total / n

    both = quick_jit(lambda p: (jax.value_and_grad(step_loss)(p),
                                grads.analytic_value_and_grad(p, tokens, targets, mask, cfg, z_loss=0.1, loss_chunk=5),
                                grads.analytic_value_and_grad(p, tokens, targets, mask, cfg, z_loss=0.1)))
    (want_loss, want), (chunked_loss, chunked), (dense_loss, dense) = both(params)
    assert float(chunked_loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert float(dense_loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert_trees_close(chunked, want, REL)
    assert_trees_close(dense, want, REL)


def test_bidirectional_denoiser_and_the_diffusion_nelbo_match_jax_grad():
    cfg = ModelConfig(**BASE, n_layers=1, causal=False)
    params = case("dynamic")[1]
    rng, mask_id = np.random.default_rng(3), cfg.vocab_size - 1
    tokens = rng.integers(0, mask_id, (B, T))
    masked = np.array([[1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1]], bool)
    z, t_b, maskable = np.where(masked, mask_id, tokens), np.array([0.35, 0.8]), np.ones((B, T))

    def loss(p):
        logits = forward(p, z, cfg, segment_ids_BT=SEGMENTS)
        return jnp.sum(diffusion.nelbo_from_logits(logits, tokens, masked, t_b, mask_id)) / maskable.sum()

    both = quick_jit(lambda p: (jax.value_and_grad(loss)(p), grads.diffusion_value_and_grad(
        p, z, tokens, masked, t_b, maskable, cfg, mask_id=mask_id, segment_ids_BT=SEGMENTS)))
    (want_loss, want), (got_loss, got) = both(params)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-13)
    assert_trees_close(got, want, REL)


# ----- 3. the branches alone, against jax.vjp of the layers ----------------------------------------------------------
def test_mamba_branch_backward_matches_vjp_of_the_associative_scan():
    """The reverse-time recurrence against autodiff through the associative scan (no hand-written backward)."""
    cfg = ModelConfig(**BASE, n_layers=1, mixer_pattern=("mamba",), ffn_pattern=("none",), **SSM,
                      ssm_scan="associative")
    layer = jax.tree.map(lambda a: a[0], case("hybrid")[1]["blocks"][0])
    layer = {k: v for k, v in layer.items() if k in layout.MAMBA}
    rng = np.random.default_rng(4)
    h, g = rng.standard_normal((B, T, cfg.d_model)), rng.standard_normal((B, T, cfg.d_model))
    ctx = Context(None, None, SEGMENTS)

    def both(h, layer, g):
        _, tape = grads.mamba_branch_forward(h, layer, cfg, SEGMENTS)
        got = grads.mamba_branch_backward(tape, layer, cfg, SEGMENTS, g)
        return got, jax.vjp(lambda h, layer: mamba_layer.branch(h, layer, cfg, ctx), h, layer)[1](g)

    (got_h, got_layer), (want_h, want_layer) = quick_jit(both)(h, layer, g)
    assert_trees_close(got_h, want_h, REL)
    assert_trees_close(got_layer, want_layer, REL)


@pytest.mark.slow
def test_attention_branch_backward_for_every_scaling_and_a_window():
    """Biases, q/k norms, each RoPE scaling and a sliding window, against jax.vjp of the layer, in one compile."""
    names = ("none", "linear", "llama3", "yarn", "dynamic")
    cfgs = {n: ModelConfig(**BASE, n_layers=1, qkv_bias=True, qk_norm=True, rope_base=100.0, rope_original_max_len=3,
                           **({"rope_scale": 0.5} if n == "linear" else
                              {} if n == "none" else {"rope_scaling": n, "rope_factor": 3.0}))
            for n in names}
    layer = jax.tree.map(lambda a: a[0], case("local_global")[1]["blocks"][0])
    layer = {k: v for k, v in layer.items() if k in layout.ATTN}
    rng = np.random.default_rng(5)
    h, g = rng.standard_normal((B, T, 8)), rng.standard_normal((B, T, 8))
    mask = window_band(causal_mask(jnp.asarray(SEGMENTS), B, T), 3)

    def run(h, layer, g):
        out = {}
        for n, cfg in cfgs.items():
            ctx = Context(jnp.asarray(POSITIONS), mask, jnp.asarray(SEGMENTS))
            _, tape = grads.attention_branch_forward(h, layer, cfg, ctx.positions_BT, mask)
            got = grads.attention_branch_backward(tape, layer, cfg, ctx.positions_BT, mask, g)
            out[n] = got, jax.vjp(lambda h, layer: attention_layer.branch(h, layer, cfg, ctx), h, layer)[1](g)
        return out

    for n, (got, want) in quick_jit(run)(h, layer, g).items():
        assert_trees_close(got, want, REL)


# ----- 4. the checker on the model: a wrong element of one leaf is named ----------------------------------------------
@pytest.mark.slow
def test_a_wrong_element_of_one_leaf_of_the_running_example_is_named():
    cfg, params, tokens, targets = examples.running_example()
    mask = np.ones(tokens.shape, bool)
    analytic = quick_jit(lambda p: grads.analytic_grad(p, tokens, targets, mask, cfg))

    def wrong(p):
        g = analytic(p)
        g["blocks"]["w_up"] = g["blocks"]["w_up"].at[0, 1, 0].multiply(1 + 1e-4)
        return g

    report = check_grads(lambda p: loss_fn(p, tokens, targets, mask, cfg), params, analytic=wrong)
    assert not report.ok
    assert report.worst()[:2] == ("blocks/w_up", ANALYTIC_VS_AUTODIFF)
    assert report.leaves["blocks/w_up"][ANALYTIC_VS_AUTODIFF].worst_index == (0, 1, 0)
    assert all(c.ok for path, comps in report.leaves.items() for c in comps.values() if path != "blocks/w_up")
