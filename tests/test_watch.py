"""Per-layer RMS diagnostics (mlx_llm.train.watch), checked against NumPy on layers sliced by hand."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import init_params
from mlx_llm.config import ModelConfig
from mlx_llm import lora
from mlx_llm.train.watch import as_row, layer_rms, watch_stats

SMALL = dict(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32, max_seq_len=32)
DENSE = ModelConfig(**SMALL)
HYBRID = ModelConfig(**SMALL, mixer_pattern=("attn", "mamba"), ssm_state=4)
MOE = ModelConfig(**SMALL, ffn_pattern=("swiglu", "moe"), n_experts=4, moe_top_k=2, moe_d_ff=6, n_shared_experts=1)
ROUTING = "router_offset"


def model(cfg, seed=0, dtype=jnp.float64):
    """A random tree in ``cfg``'s parameter layout (shapes from ``init_params`` without running its draws)."""
    return randomized(jax.eval_shape(lambda k: init_params(cfg, k, dtype), jax.random.key(0)), seed)


def randomized(tree, seed=0):
    """``tree`` with every leaf random, at a different scale per leaf and per layer row (init has constant
    gains and zero biases, which would hide a wrong layer order); routing state a large constant, so counting it
    anywhere would show."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        if jax.tree_util.keystr(path).endswith(f"'{ROUTING}']"):
            return jnp.full(x.shape, 1e3, x.dtype)
        scale = rng.uniform(0.5, 2.0, (x.shape[0],) + (1,) * (len(x.shape) - 1)) if x.shape else rng.uniform(0.5, 2.0)
        return jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def flat(entry, prefix=""):
    """{"wq": array, "wq/A": array, …} of one block entry (nested dicts joined by "/")."""
    out = {}
    for k, v in entry.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "/"))
        else:
            out[prefix + k] = np.asarray(v, np.float64)
    return out


def layers_of(blocks, n_layers):
    """Layer ℓ's leaves, sliced by hand: entry ℓ mod P of a mixed stack (a list of P dicts), row ℓ // P."""
    entries = blocks if isinstance(blocks, list) else [blocks]
    period = len(entries)
    return [{k: v[layer // period] for k, v in flat(entries[layer % period]).items() if not k.endswith(ROUTING)}
            for layer in range(n_layers)]


def rms(x):
    return np.sqrt(np.mean(np.square(np.asarray(x, np.float64))))


def expected_blocks(blocks, n_layers, prefix=""):
    layers = layers_of(blocks, n_layers)
    keys = sorted({k for layer in layers for k in layer})
    out = {prefix + k: [rms(layer[k]) for layer in layers if k in layer] for k in keys}
    out[prefix + "layer"] = [np.sqrt(sum(np.sum(np.square(v)) for v in layer.values()) /
                                     max(sum(v.size for v in layer.values()), 1)) for layer in layers]
    return out


def assert_matches(stats, expected, rtol=1e-12):
    assert set(stats) == set(expected)
    for k, want in expected.items():
        got = np.asarray(stats[k])
        assert got.shape == np.shape(want), k
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=k)


def model_expected(params, n_layers, prefix=""):
    out = expected_blocks(params["blocks"], n_layers, prefix)
    out.update({prefix + k: rms(v) for k, v in params.items() if k != "blocks"})
    return out


def test_uniform_dense_model():
    params = model(DENSE, 0)
    stats = layer_rms(params, DENSE.n_layers)
    assert_matches(stats, model_expected(params, DENSE.n_layers))
    assert set(stats) >= {"wq", "wk", "wv", "wo", "attn_norm", "ffn_norm", "w_gate", "w_up", "w_down", "layer",
                          "embed", "unembed", "final_norm"}
    wq = np.asarray(params["blocks"]["wq"])
    np.testing.assert_allclose(stats["wq"], [rms(wq[layer]) for layer in range(4)], rtol=1e-12)
    one = {k: np.asarray(v)[2] for k, v in params["blocks"].items()}
    pooled = np.sqrt(sum(np.sum(v ** 2) for v in one.values()) / sum(v.size for v in one.values()))
    np.testing.assert_allclose(stats["layer"][2], pooled, rtol=1e-12)


def test_mixed_attention_mamba_layer_order():
    params = model(HYBRID, 1)
    b = params["blocks"]
    assert isinstance(b, list) and len(b) == 2
    stats = layer_rms(params, HYBRID.n_layers)
    assert_matches(stats, model_expected(params, HYBRID.n_layers))
    # attention only in layers 0 and 2 (entry 0, rows 0 and 1); Mamba only in 1 and 3 (entry 1)
    np.testing.assert_allclose(stats["wq"], [rms(b[0]["wq"][0]), rms(b[0]["wq"][1])], rtol=1e-12)
    np.testing.assert_allclose(stats["in_x"], [rms(b[1]["in_x"][0]), rms(b[1]["in_x"][1])], rtol=1e-12)
    # every layer has an FFN: interleaved entry 0 row 0, entry 1 row 0, entry 0 row 1, entry 1 row 1
    np.testing.assert_allclose(stats["ffn_norm"], [rms(b[0]["ffn_norm"][0]), rms(b[1]["ffn_norm"][0]),
                                                   rms(b[0]["ffn_norm"][1]), rms(b[1]["ffn_norm"][1])], rtol=1e-12)
    assert stats["layer"].shape == (4,)


def test_mixed_moe_excludes_routing_state():
    params = model(MOE, 2)
    b = params["blocks"]
    assert ROUTING in b[1] and ROUTING not in b[0]
    stats = layer_rms(params, MOE.n_layers)
    assert_matches(stats, model_expected(params, MOE.n_layers))
    assert not any(ROUTING in k for k in stats)
    np.testing.assert_allclose(stats["router"], [rms(b[1]["router"][0]), rms(b[1]["router"][1])], rtol=1e-12)
    np.testing.assert_allclose(stats["w_gate"], [rms(b[0]["w_gate"][0]), rms(b[0]["w_gate"][1])], rtol=1e-12)
    assert stats["shared_up"].shape == (2,) and stats["wq"].shape == (4,)
    assert float(np.max(stats["layer"])) < 10  # the 1e3 offsets would dominate the pooled RMS of layers 1 and 3


def test_wrapped_trees_get_prefixed_keys():
    params = model(HYBRID, 3)
    head = jnp.asarray(np.random.default_rng(4).normal(size=16))
    stats = layer_rms({"policy": params, "value_head": head}, HYBRID.n_layers)
    want = model_expected(params, HYBRID.n_layers, "policy/")
    want["value_head"] = rms(head)
    assert_matches(stats, want)
    assert {"policy/wq", "policy/layer", "policy/embed", "value_head"} <= set(stats) and "layer" not in stats
    reward = layer_rms({"model": params, "reward_head": head}, HYBRID.n_layers)
    assert {"model/wq", "model/layer", "model/unembed", "reward_head"} <= set(reward)


@pytest.mark.parametrize("cfg, targets", [(DENSE, lora.LoRAConfig().targets), (HYBRID, ("wq", "in_x")),
                                          (HYBRID, ("wq",))])
def test_lora_adapters(cfg, targets):
    params = model(cfg, 5)
    adapters = randomized(lora.init(params, lora.LoRAConfig(rank=2, targets=targets), jax.random.key(6)))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(adapters))  # LoRA adapters are float32
    stats = layer_rms(adapters, cfg.n_layers)
    assert_matches(stats, expected_blocks(adapters["blocks"], cfg.n_layers), rtol=1e-6)
    assert {"wq/A", "wq/B", "layer"} <= set(stats)
    if cfg is HYBRID:
        assert stats["wq/A"].shape == (2,)
        if targets == ("wq",):  # the Mamba layers adapt nothing: their pooled RMS reads 0
            np.testing.assert_array_equal(np.asarray(stats["layer"])[[1, 3]], 0.0)
            assert np.all(np.asarray(stats["layer"])[[0, 2]] > 0)


def test_dtypes():
    bf16 = model(DENSE, 7, jnp.bfloat16)
    stats = layer_rms(bf16, DENSE.n_layers)  # accumulated in float32, from the bfloat16 values
    assert all(v.dtype == jnp.float32 for v in stats.values())
    assert_matches(stats, model_expected(bf16, DENSE.n_layers), rtol=1e-6)
    assert all(v.dtype == jnp.float64 for v in layer_rms(model(DENSE, 7), DENSE.n_layers).values())


def test_jit_matches_eager_and_row_is_json():
    params = model(MOE, 1)
    grads, updates = randomized(params, seed=2), randomized(params, seed=3)
    eager = watch_stats(params, grads, updates, MOE.n_layers)
    jitted = jax.jit(watch_stats, static_argnums=3)(params, grads, updates, MOE.n_layers)
    assert set(eager) == {"param_rms", "grad_rms", "update_rms"}
    for group in eager:
        assert set(jitted[group]) == set(eager[group])
        for k in eager[group]:
            np.testing.assert_allclose(jitted[group][k], eager[group][k], rtol=1e-12, err_msg=f"{group}/{k}")
    assert_matches(eager["grad_rms"], model_expected(grads, MOE.n_layers))
    row = json.loads(json.dumps(as_row(jitted)))
    assert set(row) == set(eager)
    for group, values in row.items():
        for k, v in values.items():
            assert isinstance(v, float) if np.ndim(eager[group][k]) == 0 else isinstance(v, list)
            np.testing.assert_allclose(v, np.asarray(jitted[group][k]), rtol=1e-15, err_msg=f"{group}/{k}")
    assert isinstance(row["param_rms"]["embed"], float) and len(row["param_rms"]["layer"]) == 4


def test_wrong_layer_count_is_refused():
    params = model(HYBRID, 9)
    with pytest.raises(ValueError, match="not 3 stacked layers"):
        layer_rms(params, 6)
    with pytest.raises(ValueError, match="not a multiple"):
        layer_rms(params, 3)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_the_step_reports_the_stats_of_its_own_state(cfg):
    """``--watch-interval``: the step's per-layer RMS equal those computed outside it from the same state and
    batch (parameters after the update, the mean gradient, the update = new − old), on watched steps only."""
    import optax

    from mlx_llm.config import TrainConfig
    from mlx_llm.train.step import init_state, lm_objective, make_train_step, optimizer_for

    tcfg = TrainConfig(batch_size=2, seq_len=8, steps=4, warmup_steps=1, watch_interval=2)
    opt = optimizer_for(tcfg)
    state = init_state(cfg, tcfg, opt)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 8), jnp.float32),
             "segment_ids": jnp.ones((2, 8), jnp.int32), "positions": jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))}
    step = jax.jit(make_train_step(cfg, tcfg, opt))
    grad_fn = jax.jit(jax.value_and_grad(lm_objective(cfg, tcfg), has_aux=True))
    for s in range(2):
        before = state.params
        (_, (n, _, _)), grads = grad_fn(before, None, batch, jax.random.key(0))
        state, m = step(state, batch)
        if s == 0:  # step 1 is not watched: zeros, and the loop writes nothing
            assert all(float(jnp.abs(v).max()) == 0 for d in m["watch"].values() for v in d.values())
            continue
        want = watch_stats(state.params, jax.tree.map(lambda g: g / n, grads),
                           optax.tree.sub(state.params, before), cfg.n_layers)
        for kind in want:
            for key in want[kind]:
                np.testing.assert_allclose(m["watch"][kind][key], want[kind][key], rtol=2e-5, atol=1e-9,
                                           err_msg=f"{kind}/{key}")


@pytest.mark.slow
def test_several_updates_per_step_report_their_mean_stats():
    """PPO's epochs × minibatches updates in one step: the stats are the mean over the step's updates (like
    its other metrics), per layer, and the spike count is the last update's."""
    from mlx_llm.config import TrainConfig
    from mlx_llm.train.step import init_state, lm_objective, make_update, optimizer_for

    cfg = ModelConfig(**{**SMALL, "n_layers": 2})
    tcfg = TrainConfig(batch_size=4, seq_len=8, steps=4, warmup_steps=1, watch_interval=1, skip_spikes=True)
    opt = optimizer_for(tcfg, 4)
    update = jax.jit(make_update(lm_objective(cfg, tcfg), tcfg, opt, epochs=2, minibatches=2, n_layers=2))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 9)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((4, 8), jnp.float32),
             "segment_ids": jnp.ones((4, 8), jnp.int32), "positions": jnp.tile(jnp.arange(8, dtype=jnp.int32), (4, 1))}
    state, m = update(init_state(cfg, tcfg, opt), batch, None)
    row = as_row(m["watch"])
    for kind in ("param_rms", "grad_rms", "update_rms"):
        assert len(row[kind]["wq"]) == 2 and all(v > 0 for v in row[kind]["layer"]), kind
    assert int(m["spikes_skipped"]) == 0 and int(state.opt_state.accepted) == 4
