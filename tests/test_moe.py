"""Mixture of experts (M20 §15, U19 §3) and the variant-ready stack: seed numbers, dispatch = dense reference,
routing state, mixed stacks, counts, bad configs, cached decoding."""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from mlx_llm import ModelConfig, forward, generate, init_params  # noqa: E402
from mlx_llm.decode.state import forward_cached, init_cache  # noqa: E402
from mlx_llm.errors import ConfigError, InputError  # noqa: E402
from mlx_llm.layers import moe  # noqa: E402
from mlx_llm.model import Context, apply_layer, embed, layer_list, logits_from_hidden  # noqa: E402
from mlx_llm.ops import causal_mask  # noqa: E402
from mlx_llm.scaling.accounting import moe_ffn_params  # noqa: E402
from mlx_llm.train.optim import make_optimizer  # noqa: E402

BASE = dict(vocab_size=13, d_model=8, n_heads=4, n_kv_heads=2, d_head=4, max_seq_len=32)


def moe_cfg(**kw):
    return ModelConfig(**{**BASE, "n_layers": 2, "ffn_pattern": ("moe",), "n_experts": 4, "moe_top_k": 2,
                          "moe_d_ff": 6, **kw})


# ----- 1. seed numbers ----------------------------------------------------------------------------------------
def test_m20_sigmoid_router_worked_example():
    ids, w = moe.route(jnp.array([0.0, 1.0, -1.0]), jnp.array([0.0, -0.5, 0.5]), 2)
    assert ids.tolist() == [2, 0]  # selection scores (0.5, 0.231059, 0.768941)
    np.testing.assert_allclose(w, [0.349755, 0.650245], atol=5e-7)
    # ε_r = 1e-9 keeps the sum just below 1: 1 − Σw = ε/(ε + 0.768941)
    assert 0 < 1 - float(w.sum()) == pytest.approx(1e-9 / (1e-9 + 0.5 + 0.268941), rel=1e-4)
    # Normalising the offset-shifted scores instead is a different router: (0.768941, 0.5)/1.268941.
    shifted = jnp.array([0.768941, 0.5]) / (1e-9 + 1.268941)
    np.testing.assert_allclose(shifted, [0.605970, 0.394030], atol=1e-6)
    assert float(jnp.abs(shifted - w).max()) > 0.25


def test_u19_softmax_router_worked_examples():
    ids, w = moe.route(jnp.array([2.0, 1.0, 0.5, -1.0]), jnp.zeros(4), 2, router="softmax")
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(w, [0.7311, 0.2689], atol=5e-5)
    # U19 Problem 5: scores (1.2, 3.0, 0.4, 2.3, others below 1) over 16 experts → experts 2 and 4 (1-based)
    logits = jnp.array([1.2, 3.0, 0.4, 2.3] + [0.5] * 12)
    ids, w = moe.route(logits, jnp.zeros(16), 2, router="softmax")
    assert (ids + 1).tolist() == [2, 4]
    np.testing.assert_allclose(w, [0.6682, 0.3318], atol=5e-5)


def test_stored_vs_active_counts_from_config():
    # U19 §3: one expert per layer of 8 experts, top 2 → a quarter of the expert numbers are used per token.
    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_head=128,
                      max_seq_len=4096, ffn_pattern=("moe",), n_experts=8, moe_top_k=2, moe_d_ff=14336)
    expert = 3 * 4096 * 14336
    assert cfg.param_count() - cfg.active_param_count() == 32 * 6 * expert
    attn = 4 * 4096 * 4096 + 4096
    router = 4096 * 8
    assert cfg.param_count() == 2 * 32000 * 4096 + 32 * (attn + 4096 + router + 8 * expert) + 4096
    assert cfg.active_param_count() == 2 * 32000 * 4096 + 32 * (attn + 4096 + router + 2 * expert) + 4096
    # U19 Problem 5 (d = 2048, 16 experts of 8d², top 2): stored 536 870 912, used 67 108 864, router 32 768.
    assert moe_ffn_params(2048, 16, 2) == (536_870_912, 67_108_864)
    assert ModelConfig(**{**BASE, "d_model": 2048}, n_layers=1, ffn_pattern=("moe",), n_experts=16, moe_top_k=2,
                       moe_d_ff=8).ffn_param_count("moe") - 2048 - 16 * 3 * 2048 * 8 == 32_768
    # M20 §8: the dense counts are unchanged; shared experts always count as active.
    small = moe_cfg(n_shared_experts=1)
    d, m = 8, 6
    per_layer_moe = d + d * 4 + (4 + 1) * 3 * d * m
    assert small.param_count() - small.active_param_count() == 2 * 2 * 3 * d * m
    assert small.param_count() == 2 * 13 * d + 2 * (2 * d * 16 + 2 * d * 8 + d + per_layer_moe) + d


@pytest.mark.slow
def test_init_params_matches_counts_and_layout():
    for cfg in (moe_cfg(), moe_cfg(n_shared_experts=2, tie_embeddings=True),
                moe_cfg(n_layers=4, d_ff=10, ffn_pattern=("moe", "swiglu"))):
        params = init_params(cfg, jax.random.key(0))
        scalars = sum(a.size for a in jax.tree.leaves(params))
        assert scalars == cfg.param_count() + cfg.routing_state_count()
    cfg = moe_cfg(n_shared_experts=2)
    blocks = init_params(cfg, jax.random.key(0))["blocks"]
    shapes = {k: v.shape for k, v in blocks.items()}
    assert shapes == {"attn_norm": (2, 8), "wq": (2, 8, 4, 4), "wk": (2, 8, 2, 4), "wv": (2, 8, 2, 4),
                      "wo": (2, 4, 4, 8), "ffn_norm": (2, 8), "router": (2, 8, 4), "router_offset": (2, 4),
                      "expert_gate": (2, 4, 8, 6), "expert_up": (2, 4, 8, 6), "expert_down": (2, 4, 6, 8),
                      "shared_gate": (2, 2, 8, 6), "shared_up": (2, 2, 8, 6), "shared_down": (2, 2, 6, 8)}
    assert "shared_gate" not in init_params(moe_cfg(), jax.random.key(0))["blocks"]


# ----- dispatch ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("k, block", [(1, 4), (2, 4), (2, 64), (3, 2)])
def test_sorted_dispatch_equals_dense_reference(k, block):
    """Values and gradients (w.r.t. inputs, weights and mixture weights) equal the all-experts reference,
    including an expert that no token chooses."""
    n, d, m, x = 37, 6, 5, 5
    keys = jax.random.split(jax.random.key(k), 6)
    y = jax.random.normal(keys[0], (n, d), jnp.float64)
    ids = jax.random.randint(keys[1], (n, k), 0, x - 1)  # expert x−1 is never chosen
    ids = jnp.where(jnp.arange(k)[None] > 0, (ids[:, :1] + jnp.arange(k)[None]) % (x - 1), ids)  # distinct
    w = jax.random.uniform(keys[2], (n, k), jnp.float64)
    wg, wu = (jax.random.normal(kk, (x, d, m), jnp.float64) for kk in keys[3:5])
    wd = jax.random.normal(keys[5], (x, m, d), jnp.float64)
    fast = lambda *a: jnp.sum(jnp.sin(moe.expert_ffn(a[0], ids, *a[1:], block=block)))
    slow = lambda *a: jnp.sum(jnp.sin(moe.dense_reference(a[0], ids, *a[1:])))
    np.testing.assert_allclose(moe.expert_ffn(y, ids, w, wg, wu, wd, block=block),
                               moe.dense_reference(y, ids, w, wg, wu, wd), atol=1e-12)
    g_fast = jax.grad(fast, argnums=(0, 1, 2, 3, 4))(y, w, wg, wu, wd)
    g_slow = jax.grad(slow, argnums=(0, 1, 2, 3, 4))(y, w, wg, wu, wd)
    for a, b in zip(g_fast, g_slow):
        np.testing.assert_allclose(a, b, atol=1e-11)
    assert float(jnp.abs(g_fast[2][x - 1]).max()) == 0.0


@pytest.mark.slow
def test_dispatch_is_dropless_when_every_token_picks_one_expert():
    """All N tokens on one expert (the worst case of any capacity scheme): every token still gets its output."""
    n, d, m, x = 50, 4, 3, 4
    y = jax.random.normal(jax.random.key(0), (n, d), jnp.float64)
    ids = jnp.zeros((n, 1), jnp.int32)
    w = jnp.ones((n, 1))
    ws = [jax.random.normal(jax.random.key(i), s, jnp.float64) for i, s in
          enumerate([(x, d, m), (x, d, m), (x, m, d)], 1)]
    np.testing.assert_allclose(moe.expert_ffn(y, ids, w, *ws, block=8), moe.dense_reference(y, ids, w, *ws),
                               atol=1e-12)


def test_dispatch_does_not_run_every_expert_on_every_token():
    """The grouped product's FLOPs follow N·k (plus padding), not N·X: count them in the compiled program."""
    n, d, m, x, k = 512, 16, 16, 16, 1
    y = jnp.ones((n, d), jnp.float32)
    ids = (jnp.arange(n) % x)[:, None]
    ws = [jnp.ones(s, jnp.float32) for s in [(x, d, m), (x, d, m), (x, m, d)]]
    cost = lambda f: jax.jit(f).lower(y, ids, jnp.ones((n, k)), *ws).compile().cost_analysis()["flops"]
    fast = cost(lambda *a: moe.expert_ffn(*a, block=32))
    slow = cost(moe.dense_reference)
    assert fast < slow / 4  # 6·N·k·d·m (+ padding ≤ X blocks) vs 6·N·X·d·m


# ----- routing state ------------------------------------------------------------------------------------------
def _tiny_batch(cfg, b=2, t=8, seed=0):
    toks = jax.random.randint(jax.random.key(seed), (b, t + 1), 0, cfg.vocab_size)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "mask": jnp.ones((b, t)),
            "segment_ids": jnp.zeros((b, t), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(t), (b, t))}


@pytest.mark.slow
def test_offsets_get_exactly_zero_gradient_and_no_optimizer_state():
    cfg = moe_cfg()
    params = init_params(cfg, jax.random.key(1), jnp.float64)
    params["blocks"]["router_offset"] = 0.3 * jax.random.normal(jax.random.key(2), (2, 4), jnp.float64)
    batch = _tiny_batch(cfg)

    def loss(p):
        logits = forward(p, batch["tokens"], cfg)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["blocks"]["router_offset"]).max()) == 0.0
    assert float(jnp.abs(grads["blocks"]["router"]).max()) > 0
    opt = make_optimizer(1e-2, weight_decay=0.5)
    state = opt.init(params)
    assert all(a.shape != (2, 4) for a in jax.tree.leaves(state))  # AdamW keeps no moments for offsets
    grads["blocks"]["router_offset"] = jnp.ones((2, 4))  # even a (wrong) gradient could not move them
    updates, _ = opt.update(grads, state, params)
    assert float(jnp.abs(updates["blocks"]["router_offset"]).max()) == 0.0


def test_offsets_steer_selection():
    """A large offset on one expert puts it in every token's set: offsets choose, scores weigh."""
    cfg = moe_cfg(moe_top_k=1)
    params = init_params(cfg, jax.random.key(1), jnp.float64)
    tokens = jnp.arange(8)[None]
    base = forward(params, tokens, cfg)
    params["blocks"]["router_offset"] = jnp.array([[0.0, 0.0, 5.0, 0.0]] * 2)
    _, aux = __import__("mlx_llm").model.hidden_states(params, tokens, cfg, return_aux=True)
    assert aux["router_offset"].tolist() == [[0, 0, 8, 0], [0, 0, 8, 0]]
    assert float(jnp.abs(forward(params, tokens, cfg) - base).max()) > 1e-3


def test_control_rule_moves_each_offset_by_u():
    offsets = jnp.array([0.1, -0.2, 0.0, 0.3])
    load = jnp.array([10.0, 2.0, 4.0, 4.0])  # mean 5: expert 0 overloaded, 1–3 under
    np.testing.assert_allclose(moe.update_offsets(offsets, load, 0.01), offsets + 0.01 * jnp.array([-1, 1, 1, 1]))
    even = jnp.array([5.0, 5.0, 5.0, 5.0])
    np.testing.assert_array_equal(moe.update_offsets(offsets, even, 0.01), offsets)
    with pytest.raises(InputError, match=r"load has shape \(3,\) but offsets have \(4,\)"):
        moe.update_offsets(offsets, jnp.ones(3), 0.01)
    # computed in the offsets' precision: float64 offsets move by exactly the float64 u (0.1 + 0.05, not
    # 0.1500000022 from a float32 step), float32 offsets by the float32 u
    f64, signs = np.array([0.1, -0.2, 0.0, 0.3]), np.array([-1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(moe.update_offsets(jnp.asarray(f64), load, 0.05), f64 + 0.05 * signs)
    f32 = moe.update_offsets(jnp.asarray(f64, jnp.float32), load, 0.05)
    assert f32.dtype == jnp.float32
    np.testing.assert_array_equal(f32, f64.astype(np.float32) + np.float32(0.05) * signs.astype(np.float32))


@pytest.mark.slow
def test_train_step_applies_control_rule_with_global_load():
    """One jitted train step (2 micro-batches): each offset moves by exactly ±u, against its expert's load
    counted over the whole step, and the loss gradient never touches it."""
    from mlx_llm.config import TrainConfig
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for

    u = 0.125
    cfg = moe_cfg(offset_rate=u, vocab_size=32)
    tcfg = TrainConfig(batch_size=4, seq_len=8, steps=3, warmup_steps=0, grad_accum=2)
    mesh = make_mesh()
    state = init_state(cfg, tcfg, optimizer_for(tcfg))
    batch = {k: np.asarray(v) for k, v in _tiny_batch(cfg, b=4).items()}
    before = np.asarray(state.params["blocks"]["router_offset"])
    new, metrics = jit_train_step(cfg, tcfg, mesh)(state, device_batch(batch, mesh))
    load = np.asarray(metrics["expert_load"]["router_offset"])
    assert load.sum() == 2 * 4 * 8 * 2  # layers × tokens × k, across both micro-batches
    want = before + u * np.sign(load.mean(axis=-1, keepdims=True) - load)
    np.testing.assert_array_equal(np.asarray(new.params["blocks"]["router_offset"]), want)
    assert (np.abs(np.asarray(new.params["blocks"]["router_offset"]) - before) == u).sum() >= 1


# ----- the stack ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mixed_stack_equals_layers_run_one_by_one():
    cfg = ModelConfig(**BASE, n_layers=4, d_ff=10, ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2,
                      moe_d_ff=6, n_shared_experts=1)
    params = init_params(cfg, jax.random.key(3), jnp.float64)
    assert isinstance(params["blocks"], list) and len(params["blocks"]) == 2
    assert params["blocks"][0]["router"].shape == (2, 8, 4) and params["blocks"][1]["w_gate"].shape == (2, 8, 10)
    tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, 13)
    ctx = Context(jnp.broadcast_to(jnp.arange(9), (2, 9)), causal_mask(None, 2, 9))
    h = embed(params, tokens)
    kinds_seen = []
    for layer, kinds in layer_list(params, cfg):
        h, _ = apply_layer(h, layer, kinds, cfg, ctx)
        kinds_seen.append(kinds[1])
    assert kinds_seen == ["moe", "swiglu", "moe", "swiglu"]
    np.testing.assert_allclose(forward(params, tokens, cfg), logits_from_hidden(h, params, cfg), atol=1e-12)


def test_mixed_stack_is_one_scan_over_groups():
    cfg = ModelConfig(**BASE, n_layers=6, d_ff=10, ffn_pattern=("moe", "swiglu", "none"), n_experts=4,
                      moe_top_k=1, moe_d_ff=6)
    params = init_params(cfg, jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda p, t: forward(p, t, cfg))(params, jnp.zeros((1, 4), jnp.int32))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 2
    assert "ffn_norm" not in params["blocks"][2]  # an FFN of kind "none" has no keys


@pytest.mark.parametrize("change, message", [
    (dict(moe_top_k=5), r"moe_top_k = 5 is invalid: it must be in \[1, n_experts = 4\]"),
    (dict(moe_top_k=0), r"moe_top_k = 0 is invalid: it must be a positive integer"),
    (dict(router="relu"), r"router = 'relu' is invalid: valid routers are \['sigmoid', 'softmax'\]"),
    (dict(ffn_pattern=("moe", "dense")), r"ffn_pattern = \['moe', 'dense'\] has unknown kind\(s\) \['dense'\]"),
    (dict(mixer_pattern=("rnn",)), r"mixer_pattern = \['rnn'\] has unknown kind\(s\) \['rnn'\]"),
    (dict(mixer_pattern=()), r"mixer_pattern = \(\) is invalid: it must be a non-empty list"),
    (dict(n_layers=3, ffn_pattern=("moe", "swiglu"), d_ff=8), r"n_layers = 3 is not a multiple of the stack's period 2"),
    (dict(n_experts=None), r"n_experts is not set: layers of kind 'moe' need it"),
    (dict(n_shared_experts=-1), r"n_shared_experts = -1 is invalid: it must be an integer >= 0"),
    (dict(offset_rate=-0.1), r"offset_rate = -0.1 is invalid"),
    (dict(router_eps=float("nan")), r"router_eps = nan is invalid"),
])
def test_bad_moe_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        moe_cfg(**change)


def test_bad_route_arguments():
    with pytest.raises(InputError, match=r"offsets have shape \(3,\); expected \(4,\), one per expert"):
        moe.route(jnp.zeros((2, 4)), jnp.zeros(3), 2)
    with pytest.raises(ConfigError, match=r"top_k = 5 is invalid: it must be an integer in \[1, n_experts = 4\]"):
        moe.route(jnp.zeros((2, 4)), jnp.zeros(4), 5)
    with pytest.raises(ConfigError, match=r"router = 'topk' is invalid"):
        moe.route(jnp.zeros((2, 4)), jnp.zeros(4), 2, router="topk")


def test_json_round_trip_keeps_patterns_hashable(tmp_path):
    cfg = moe_cfg(n_layers=4, d_ff=10, ffn_pattern=("moe", "swiglu"), router="softmax", offset_rate=1e-3)
    cfg.to_json(tmp_path / "c.json")
    back = ModelConfig.from_json(tmp_path / "c.json")
    assert back == cfg and hash(back) == hash(cfg) and back.ffn_pattern == ("moe", "swiglu")


# ----- decoding -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("pattern", [("moe",), ("moe", "swiglu")])
def test_cached_decoding_equals_full_forward(pattern):
    cfg = moe_cfg(n_layers=2, ffn_pattern=pattern, d_ff=10, n_shared_experts=1, router="softmax")
    params = init_params(cfg, jax.random.key(5), jnp.float64)
    params = jax.tree.map(lambda a: a, params)
    tokens = jax.random.randint(jax.random.key(6), (2, 10), 0, 13)
    full = forward(params, tokens, cfg)
    cache = init_cache(cfg, 2, 16, jnp.float64)
    logits, cache = forward_cached(params, tokens[:, :6], cache, cfg)
    steps = [logits]
    for t in range(6, 10):
        logits, cache = forward_cached(params, tokens[:, t:t + 1], cache, cfg)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-11)


@pytest.mark.slow
def test_generate_greedy_matches_argmax_of_forward():
    cfg = moe_cfg(n_layers=2, vocab_size=13)
    params = init_params(cfg, jax.random.key(7), jnp.float64)
    prompt = jnp.array([[1, 2, 3]])
    out = generate(params, cfg, prompt, 6)
    # greedy: each token is the forward's argmax after the ones before it (a causal forward of the prompt and the
    # first five tokens scores all six steps at once; routing is per token, so no other token changes a step)
    logits = forward(params, jnp.concatenate([prompt, out.tokens[:, :5]], axis=1), cfg)
    assert out.tokens[0].tolist() == jnp.argmax(logits[0, 2:], -1).tolist()


@pytest.mark.slow
def test_public_api_at_the_package_root():
    import mlx_llm
    from mlx_llm.decode.generate import generate as generate_fn

    assert mlx_llm.generate is generate_fn and callable(mlx_llm.generate)
    assert mlx_llm.forward is forward and mlx_llm.init_params is init_params and mlx_llm.ModelConfig is ModelConfig
