"""LoRA adapters (mlx_llm.lora; U19 §10): counts, rank, exact start, merge, and a frozen base."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mlx_llm import init_params
from mlx_llm import forward as _forward
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.loss import masked_cross_entropy
from mlx_llm import lora
from mlx_llm.scaling.accounting import lora_minillm_params, lora_params
from helpers import tiny_cfg

CFG = tiny_cfg(vocab_size=32, d_ff=24, max_seq_len=16)
HYBRID = tiny_cfg(vocab_size=32, d_ff=24, max_seq_len=16, mixer_pattern=("mamba", "attn"),
                  ffn_pattern=("none", "swiglu"), ssm_state=4)
forward = jax.jit(_forward, static_argnums=2)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 12)))


@pytest.fixture(scope="module")
def base():
    return init_params(CFG, jax.random.key(0), jnp.float64)


def random_adapters(params, cfg: lora.LoRAConfig, seed=1):
    """Adapters with B random too (init has B = 0), so the update is not zero."""
    ad = lora.init(params, cfg, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, a.shape, jnp.float64) for k, a in zip(keys, leaves)])


def test_u19_s10_counts_and_rank():
    assert lora_params(4096, 4096, 8) == 65_536 and 4096 * 4096 == 16_777_216
    assert lora_params(1024, 1024, 4) == 8_192
    a = jnp.asarray([[1.0], [0.0], [2.0]])  # U19 §10's B = (1, 0, 2)ᵀ, A = (1, −1, 0.5): here ΔW = A·B, x·W order
    b = jnp.asarray([[1.0, -1.0, 0.5]])
    dw = np.asarray(lora.delta(a, b, 1.0))
    assert dw.tolist() == [[1.0, -1.0, 0.5], [0.0, 0.0, 0.0], [2.0, -2.0, 1.0]]
    assert np.linalg.matrix_rank(dw) == 1 and a.size + b.size == 6 and dw.size == 9


@pytest.mark.parametrize("targets", [("wq", "wv"), ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")])
def test_adapter_count_matches_accounting(base, targets):
    cfg = lora.LoRAConfig(rank=3, alpha=6.0, targets=targets)
    ad = lora.init(base, cfg, jax.random.key(0))
    assert lora.param_count(ad) == lora_minillm_params(CFG, 3, targets)
    for t in targets:
        assert np.all(np.asarray(ad["blocks"][t]["B"]) == 0) and np.std(np.asarray(ad["blocks"][t]["A"])) > 0.1


def test_zero_B_starts_exactly_at_the_base(base):
    cfg = lora.LoRAConfig(rank=2, targets=("wq", "wv", "wo"))
    ad = lora.init(base, cfg, jax.random.key(0))
    assert np.array_equal(np.asarray(forward(lora.adapted(base, ad, cfg), TOKENS, CFG)),
                          np.asarray(forward(base, TOKENS, CFG)))


@pytest.mark.slow
def test_merged_equals_unmerged(base):
    """The merged weight W₀ + (α/r)·A·B against the unmerged product x·W₀ + (α/r)·(x·A)·B for every adapted
    key (float64), and the merged model's logits against the adapted forward's."""
    cfg = lora.LoRAConfig(rank=2, alpha=3.0, targets=("wq", "wv", "wo", "w_down"))
    ad = random_adapters(base, cfg)
    merged = lora.merge(base, ad, cfg)
    for t in cfg.targets:
        for layer in range(CFG.n_layers):
            w0 = np.asarray(base["blocks"][t][layer])
            d_in = int(np.prod(w0.shape[:lora.TARGETS[t]]))
            xi = np.random.default_rng(layer).standard_normal((7, d_in))
            a, b = np.asarray(ad["blocks"][t]["A"][layer]), np.asarray(ad["blocks"][t]["B"][layer])
            unmerged = xi @ w0.reshape(d_in, -1) + cfg.scale * (xi @ a) @ b
            got = xi @ np.asarray(merged["blocks"][t][layer]).reshape(d_in, -1)
            assert np.max(np.abs(got - unmerged)) <= 1e-12
            assert np.max(np.abs(unmerged - xi @ w0.reshape(d_in, -1))) > 1e-3  # the adapter does something
    assert np.max(np.abs(np.asarray(forward(merged, TOKENS, CFG))
                         - np.asarray(forward(lora.adapted(base, ad, cfg), TOKENS, CFG)))) <= 1e-12


@pytest.mark.slow
def test_training_moves_only_the_adapters(base):
    cfg = lora.LoRAConfig(rank=2, alpha=4.0)
    ad = lora.init(base, cfg, jax.random.key(0))
    frozen = jax.tree.map(lambda a: np.array(a, copy=True), base)
    opt = optax.adam(3e-2)
    state = opt.init(ad)
    targets, mask = jnp.roll(TOKENS, -1, axis=1), jnp.ones(TOKENS.shape).at[:, -1].set(0)

    def loss(adapters):  # a function of the adapters alone: the base is a constant, never differentiated
        return masked_cross_entropy(forward(lora.adapted(base, adapters, cfg), TOKENS, CFG), targets, mask)

    @jax.jit
    def step(ad, state):
        value, grads = jax.value_and_grad(loss)(ad)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(ad, updates), state, value

    losses = []
    for _ in range(8):
        ad, state, value = step(ad, state)
        losses.append(float(value))
    assert losses[-1] < losses[0] - 0.1
    assert jax.tree.structure(jax.grad(loss)(ad)) == jax.tree.structure(ad)
    for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(frozen)):
        assert np.array_equal(np.asarray(got), want)  # bitwise unchanged
    assert np.max(np.abs(np.asarray(ad["blocks"]["wq"]["B"]))) > 0


@pytest.mark.slow
def test_mixed_stack_adapts_only_layers_that_have_the_target():
    params = init_params(HYBRID, jax.random.key(0))
    cfg = lora.LoRAConfig(rank=2, targets=("wq", "in_x"))
    ad = lora.init(params, cfg, jax.random.key(1))
    assert set(ad["blocks"][0]) == {"in_x"} and set(ad["blocks"][1]) == {"wq"}
    assert ad["blocks"][0]["in_x"]["A"].shape == (1, 16, 2) and ad["blocks"][1]["wq"]["B"].shape == (1, 2, 16)
    out = forward(lora.adapted(params, ad, cfg), TOKENS, HYBRID)
    assert np.array_equal(np.asarray(out), np.asarray(forward(params, TOKENS, HYBRID)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), r"LoRA rank = 0 is invalid"),
    (dict(alpha=-1.0), r"LoRA alpha = -1.0 is invalid"),
    (dict(targets=("wq", "embed")), r"LoRA targets \['wq', 'embed'\] are invalid"),
    (dict(targets=()), r"LoRA targets \[\] are invalid"),
])
def test_bad_lora_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        lora.LoRAConfig(**kwargs)


def test_target_missing_from_the_model(base):
    with pytest.raises(ConfigError, match=r"LoRA targets \['in_x'\] are not weights of this model"):
        lora.init(base, lora.LoRAConfig(targets=("wq", "in_x")), jax.random.key(0))


def test_update_is_alpha_over_rank_times_the_product_by_hand():
    """The merged weight is W₀ + (α/r)·A·B: with α = 6 and r = 2 the product A·B enters 3 times (the constant
    written here, not read back from ``LoRAConfig.scale``)."""
    cfg = tiny_cfg(n_layers=1)
    base = init_params(cfg, jax.random.key(0), jnp.float64)
    w0 = np.asarray(base["blocks"]["wq"])  # (1, D, H, K)
    a = np.arange(cfg.d_model * 2, dtype=np.float64).reshape(1, cfg.d_model, 2) / 100
    b = np.arange(2 * cfg.n_heads * cfg.d_head, dtype=np.float64).reshape(1, 2, -1) / 100
    adapters = {"blocks": {"wq": {"A": jnp.asarray(a), "B": jnp.asarray(b)}}}
    merged = lora.merge(base, adapters, lora.LoRAConfig(rank=2, alpha=6.0, targets=("wq",)))
    np.testing.assert_allclose(np.asarray(merged["blocks"]["wq"]), w0 + 3.0 * (a @ b).reshape(w0.shape), rtol=1e-14)
    np.testing.assert_array_equal(np.asarray(merged["blocks"]["wv"]), np.asarray(base["blocks"]["wv"]))


def test_default_adapters_are_rank_8_on_the_query_and_value_matrices():
    """U19 §10: "A common choice puts one on the query matrix and one on the value matrix of every layer", with
    r = 8 in its worked count (2 × 4 096 × 8 = 65 536 numbers per adapted 4 096² matrix)."""
    default = lora.LoRAConfig()
    assert (default.rank, default.targets) == (8, ("wq", "wv"))
    assert lora_params(4096, 4096, default.rank) == 65_536
