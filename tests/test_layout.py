"""The parameter layout declared once (mlx_llm.layers.layout): the declared shapes are ``init_params``' shapes,
every array is declared, the counts summed from the declarations equal the scalars of the tree and the closed
forms, and the tables derived from it (tensor axes, LoRA targets, draws) are the ones the code used before."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, init_params
from mlx_llm.layers import attention, ffn, layout, mamba, moe
from mlx_llm.model import _DRAWS
from mlx_llm import lora
from mlx_llm.scaling.accounting import lora_minillm_params, mamba_matmul_params, matmul_params, tree_size
from mlx_llm.train import optim, parallel

BASE = dict(vocab_size=37, d_model=16, max_seq_len=32)
ATTN = dict(n_heads=4, n_kv_heads=2, d_head=4)
MOE = dict(n_experts=4, moe_top_k=2, moe_d_ff=8)
CFGS = {
    "dense": ModelConfig(**BASE, **ATTN, n_layers=2, d_ff=24),
    "dense_tied": ModelConfig(**BASE, n_layers=3, n_heads=2, n_kv_heads=1, d_head=8, d_ff=20, tie_embeddings=True),
    "moe_shared": ModelConfig(**BASE, **ATTN, **MOE, n_layers=2, ffn_pattern=("moe",), n_shared_experts=2),
    "moe_tied": ModelConfig(**BASE, **ATTN, **MOE, n_layers=2, ffn_pattern=("moe",), tie_embeddings=True),
    "mamba": ModelConfig(**BASE, n_layers=3, mixer_pattern=("mamba",), ffn_pattern=("none",), ssm_dt_rank=3),
    "hybrid": ModelConfig(**BASE, **ATTN, **MOE, n_layers=4, d_ff=24, n_shared_experts=1,
                          mixer_pattern=("mamba", "attn"), ffn_pattern=("moe", "swiglu", "none", "moe")),
}

# The tables the code held before the layout was declared once.
OLD_TENSOR_AXIS = {
    "embed": 0, "unembed": 1,
    "wq": 1, "wk": 1, "wv": 1, "wo": 0, "bq": 0, "bk": 0, "bv": 0,  # the biases split with their heads
    "w_gate": 1, "w_up": 1, "w_down": 0,
    "expert_gate": 2, "expert_up": 2, "expert_down": 1,
    "shared_gate": 2, "shared_up": 2, "shared_down": 1,
    "in_x": 1, "in_z": 1, "conv_w": 1, "conv_b": 0, "w_dt": 0, "w_B": 0, "w_C": 0, "dt_proj": 1, "dt_bias": 0,
    "A_log": 0, "D": 0, "out_proj": 0,
}
OLD_TARGETS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1,
               "in_x": 1, "in_z": 1, "out_proj": 1}


def tree_shapes(tree):
    return jax.tree.map(lambda a: tuple(a.shape), tree)


def abstract_params(cfg):
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


# ----- shapes: declared = initialised, key for key --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CFGS))
def test_declared_shapes_are_init_params_shapes(name):
    cfg = CFGS[name]
    got = tree_shapes(abstract_params(cfg))
    want = layout.param_shapes(cfg)
    assert jax.tree.structure(got, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree.structure(want, is_leaf=lambda x: isinstance(x, tuple))  # same keys: all declared, all present
    assert got == want


def test_dense_shapes_are_design_s1():
    got = layout.param_shapes(CFGS["dense"])
    assert got == {"embed": (37, 16), "final_norm": (16,), "unembed": (16, 37),
                   "blocks": {"attn_norm": (2, 16), "wq": (2, 16, 4, 4), "wk": (2, 16, 2, 4), "wv": (2, 16, 2, 4),
                              "wo": (2, 4, 4, 16), "ffn_norm": (2, 16), "w_gate": (2, 16, 24),
                              "w_up": (2, 16, 24), "w_down": (2, 24, 16)}}
    assert "unembed" not in layout.param_shapes(CFGS["dense_tied"])


def test_hybrid_groups_and_shared_experts():
    blocks = layout.param_shapes(CFGS["hybrid"])["blocks"]
    for b, (m, f) in zip(blocks, CFGS["hybrid"].group_kinds):
        declared = {**layout.KINDS[m], **layout.KINDS[f]}  # less the optional arrays (biases, q/k norms)
        assert sorted(b) == sorted(k for k, info in declared.items() if info.present is None)
    assert blocks[0]["shared_down"] == (1, 1, 8, 16) and blocks[0]["in_x"] == (1, 16, 32)
    assert blocks[1]["wq"] == (1, 16, 4, 4) and "router" not in blocks[1]
    no_shared = layout.param_shapes(CFGS["moe_tied"])["blocks"]
    assert "shared_gate" not in no_shared and no_shared["expert_down"] == (2, 4, 8, 16)


def test_layer_inits_take_their_declared_draws_in_table_order():
    calls = []

    def normal(shape, std):
        calls.append((shape, std))
        return jnp.zeros(shape)

    cfg = CFGS["hybrid"]
    p = moe.init(cfg, normal, 2, jnp.float32)
    assert [c[0] for c in calls] == [(2, 16, 4), (2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 8, 16), (2, 1, 16, 8),
                                     (2, 1, 16, 8), (2, 1, 8, 16)]
    assert calls[0][1] == 1 / math.sqrt(16) and calls[3][1] == (1.0 / math.sqrt(8)) / math.sqrt(8)
    assert list(p) == [k for k, i in layout.MOE.items() if layout.present(i, cfg)]
    assert np.all(np.asarray(p["router_offset"]) == 0)
    calls.clear()
    attention.init(cfg, normal, 2, jnp.float32)
    assert calls == [((2, 16, 4, 4), 0.25), ((2, 16, 2, 4), 0.25), ((2, 16, 2, 4), 0.25),
                     ((2, 4, 4, 16), (1.0 / math.sqrt(8)) / math.sqrt(16))]
    calls.clear()
    ffn.init(CFGS["dense"], normal, 2, jnp.float32)
    assert calls == [((2, 16, 24), 0.25), ((2, 16, 24), 0.25), ((2, 24, 16), 0.5 / math.sqrt(24))]
    calls.clear()
    mamba.init(cfg, normal, 1, jnp.float32)
    assert [c[0] for c in calls] == [(1, 16, 32), (1, 16, 32), (1, 4, 32), (1, 32, 1), (1, 32, 16), (1, 32, 16),
                                     (1, 1, 32), (1, 32), (1, 32, 16)]


def test_moe_without_shared_experts_still_draws_them():
    calls = []
    p = moe.init(CFGS["moe_tied"], lambda s, std: calls.append(s) or jnp.zeros(s), 2, jnp.float32)
    assert len(calls) == 7 and calls[4:] == [(2, 0, 16, 8), (2, 0, 16, 8), (2, 0, 8, 16)]
    assert "shared_gate" not in p


def test_draws_per_kind():
    assert _DRAWS == {"attn": 4, "local": 4, "mamba": 9, "swiglu": 3, "geglu": 3, "relu2": 2, "moe": 7, "none": 0}
    assert layout.draws(layout.TOP) == 2 and mamba.DRAWS == 9


@pytest.mark.slow
def test_init_params_values_follow_the_declared_rules():
    cfg = CFGS["hybrid"]
    p = init_params(cfg, jax.random.key(1), jnp.float32)
    b0 = p["blocks"][0]
    assert np.all(np.asarray(b0["ssm_norm"]) == 1) and np.all(np.asarray(b0["conv_b"]) == 0)
    assert np.all(np.asarray(b0["D"]) == 1) and np.all(np.asarray(b0["router_offset"]) == 0)
    assert np.allclose(np.asarray(b0["A_log"])[0, 0], np.log(np.arange(1, 17)))
    assert np.all(np.asarray(p["final_norm"]) == 1)
    assert 0.5 < float(np.std(np.asarray(p["embed"]))) < 1.5  # untied: N(0, 1)


# ----- counts: declared = the tree's scalars = the closed forms --------------------------------------------------
def theta_size(params):
    """Scalars of θ: every leaf but the routing state."""
    return tree_size(optim.strip_routing_state(params))


@pytest.mark.parametrize("name", sorted(CFGS))
def test_param_count_is_the_size_of_init_params(name):
    cfg = CFGS[name]
    params = abstract_params(cfg)
    assert cfg.param_count() == theta_size(params)
    assert cfg.routing_state_count() == tree_size(params) - theta_size(params)
    tables = params["embed"].size + (0 if cfg.tie_embeddings else params["unembed"].size)
    assert cfg.non_embedding_param_count() == theta_size(params) - tables


def test_counts_equal_the_closed_forms():
    d, V = 16, 37
    dense = CFGS["dense"]  # M20 §8: n_E·V·d + L(2d·h_q·d_h + 2d·h_kv·d_h + 3dm + 2d) + d
    assert dense.param_count() == 2 * V * d + 2 * (2 * d * 16 + 2 * d * 8 + 3 * d * 24 + 2 * d) + d == 5104
    assert CFGS["dense_tied"].param_count() == V * d + 3 * (2 * d * 16 + 2 * d * 8 + 3 * d * 20 + 2 * d) + d
    shared = CFGS["moe_shared"]  # d + dX + (X + S)·3d·m_e stored, (k + S)·3d·m_e active
    assert shared.ffn_param_count("moe") == d + d * 4 + 6 * 3 * d * 8 == 2384
    assert shared.ffn_param_count("moe", active=True) == d + d * 4 + 4 * 3 * d * 8 == 1616
    attn = 2 * d * 16 + 2 * d * 8 + d
    assert shared.active_param_count() == 2 * V * d + 2 * (attn + 1616) + d
    assert shared.routing_state_count() == 2 * 4
    m = CFGS["mamba"]  # I = 32, N = 16, W = 4, R = 3
    i, n, w, r = 32, 16, 4, 3
    assert m.mamba_param_count() == d + 2 * d * i + w * i + i + 2 * i * r + i + 3 * i * n + i + i * d == 3504
    assert mamba_matmul_params(m) == 3 * d * i + 2 * i * (r + n) == 2752
    assert matmul_params(m) == d * V + 3 * 2752
    hybrid = CFGS["hybrid"]  # layers: mamba+moe, attn+swiglu, mamba+none, attn+moe
    moe_active = d * 4 + 3 * 3 * d * 8
    mamba_mm = 3 * d * i + 2 * i * (1 + n)  # R = ⌈16/16⌉ = 1
    assert matmul_params(hybrid) == d * V + 2 * mamba_mm + 2 * (attn - d) + 3 * d * 24 + 2 * moe_active == 10960


def test_mixed_count_is_per_layer_sum():
    cfg = CFGS["hybrid"]
    per_layer = [cfg.mixer_param_count(mk) + cfg.ffn_param_count(fk) for mk, fk in
                 (cfg.layer_kinds(l) for l in range(cfg.n_layers))]
    assert cfg.param_count() == sum(per_layer) + 2 * 37 * 16 + 16
    assert cfg.ffn_param_count("none") == 0


# ----- derived tables ---------------------------------------------------------------------------------------
def test_tensor_axis_is_the_old_table():
    knobs = {"value_embed": 1}  # the value embeddings split with their heads
    assert parallel.TENSOR_AXIS == layout.tensor_axes() == {**OLD_TENSOR_AXIS, **knobs}


def test_lora_targets_are_the_old_table():
    assert lora.TARGETS == layout.lora_targets() == OLD_TARGETS
    assert list(lora.TARGETS) == list(OLD_TARGETS)  # the order its error message lists


def test_lora_count_matches_declared_matrices():
    dense = CFGS["dense"]  # wq: 16 × 16, wo: 16 × 16 (h·d_h in), wk: 16 × 8, w_down: 24 × 16
    assert lora_minillm_params(dense, 2, ("wq", "wo", "wk", "w_down")) == 2 * 2 * (32 + 32 + 24 + 40)
    assert lora_minillm_params(CFGS["hybrid"], 1, ("in_x", "wq")) == 2 * (16 + 32) + 2 * (16 + 16)


def test_roles_agree_with_the_optimizer():
    infos = layout.entries()
    norms = {k for k, i in infos.items() if i.role == "norm"}
    assert norms == {"attn_norm", "ffn_norm", "ssm_norm", "final_norm", "q_norm", "k_norm", "post_attn_norm",
                     "post_ffn_norm", "mtp_h_norm", "mtp_e_norm"}
    # M20 §12 decays the weight matrices; Mamba's vectors and A_log, and the q/k/v biases do not decay (Gu & Dao's
    # _no_weight_decay; biases are not matrices), nor do the knobs' scalars (value gates, U-net skip weights)
    assert {k for k, i in infos.items() if not i.decayed} == norms | {"router_offset", "conv_b", "dt_bias",
                                                                      "A_log", "D", "bq", "bk", "bv",
                                                                      "value_gate", "skip_weights"}
    assert tuple(k for k, i in infos.items() if i.role == "state") == optim.ROUTING_STATE_KEYS


def test_tensor_axis_splits_the_declared_dimension():
    """The axis ``tensor`` splits is a head, width or vocabulary axis of its declaration, never d alone."""
    split = {k: i.dims[i.tensor_axis] for k, i in layout.entries().items() if i.tensor_axis is not None}
    assert set(split.values()) == {"V", "H", "G", "F", "M", "I"}
    assert split["wo"] == "H" and split["expert_down"] == "M" and split["conv_w"] == "I"


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="std"):
        layout.ParamInfo(("D",), "normal")
    with pytest.raises(ValueError, match="role"):
        layout.ParamInfo(("D",), "ones", role="bias")
    with pytest.raises(ValueError, match="outside"):
        layout.ParamInfo(("D", "F"), std=layout.fan_in("D"), tensor_axis=2)
    with pytest.raises(ValueError, match="outside"):
        layout.ParamInfo(("D", "F"), std=layout.fan_in("D"), lora_in=2)  # no output axis left
