"""``mlx_llm.forward`` against an independent NumPy float64 reference (tests/numpy_reference.py).

Random small configs (MoE with both routers, shared experts, GQA, tied/untied embeddings, nonzero balancing
offsets), a mixed moe/swiglu stack and the dense default must all match to 1e-10 in float64. A last test
checks that the offsets really steer selection, so a library that ignored them could not pass.
"""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import numpy_reference as ref  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)
from mlx_llm import ModelConfig, forward, init_params  # noqa: E402

TOL = 1e-10
B, T, V = 2, 7, 11
ATTN = dict(n_heads=4, n_kv_heads=2, d_head=4, d_model=8)
_forward = jax.jit(forward, static_argnums=2)  # the same function; jit only caches the compile per config


def key(seed: int) -> jax.Array:
    """An RBG key: its normal draws compile in a fraction of threefry's time on CPU (the weights are just
    test data; init_params takes any key)."""
    return jax.random.key(seed, impl="rbg")


def run(params, tokens, cfg) -> np.ndarray:
    return np.asarray(_forward(params, jnp.asarray(tokens), cfg))


def _random_case(i: int):
    """Case i: a MoE config and its params/offsets/tokens, all from numpy seed 1000 + i."""
    rng = np.random.default_rng(1000 + i)
    cfg = ModelConfig(
        vocab_size=V, n_layers=2, max_seq_len=16, **ATTN,
        ffn_pattern=("moe",),
        n_experts=int(rng.choice([4, 8])),
        moe_top_k=int(rng.choice([1, 2])),
        n_shared_experts=i % 3,
        moe_d_ff=int(rng.choice([3, 6])),
        router=("sigmoid", "softmax")[i % 2],
        tie_embeddings=bool(i % 4 == 3),
        rope_base=float(rng.choice([10000.0, 50.0])),
        rope_scale=float(rng.choice([1.0, 0.5])),
    )
    params = init_params(cfg, key(i), dtype=jnp.float64)
    offsets = jnp.asarray(0.3 * rng.standard_normal((cfg.n_layers, cfg.n_experts)))
    params = {**params, "blocks": {**params["blocks"], "router_offset": offsets}}
    tokens = rng.integers(0, V, (B, T))
    return cfg, params, tokens


def _max_diff(params, tokens, cfg) -> float:
    got = run(params, tokens, cfg)
    assert got.dtype == np.float64
    want = ref.forward(params, tokens, cfg)
    assert got.shape == want.shape == (B, T, cfg.vocab_size)
    return float(np.max(np.abs(got - want)))


@pytest.mark.slow
@pytest.mark.parametrize("case", range(8))
def test_random_moe_configs_match_reference(case):
    cfg, params, tokens = _random_case(case)
    assert np.any(np.asarray(params["blocks"]["router_offset"]) != 0)
    diff = _max_diff(params, tokens, cfg)
    print(f"\ncase {case}: X={cfg.n_experts} k={cfg.moe_top_k} S={cfg.n_shared_experts} m={cfg.moe_d_ff} "
          f"router={cfg.router} tied={cfg.tie_embeddings} max|diff|={diff:.3e}")
    assert diff <= TOL, (cfg, diff)


def test_mixed_moe_swiglu_stack_matches_reference():
    rng = np.random.default_rng(7)
    cfg = ModelConfig(vocab_size=V, n_layers=4, max_seq_len=16, **ATTN, ffn_pattern=("moe", "swiglu"), d_ff=10,
                      n_experts=4, moe_top_k=2, n_shared_experts=1, moe_d_ff=6, router="sigmoid")
    params = init_params(cfg, key(42), dtype=jnp.float64)
    blocks = params["blocks"]
    assert isinstance(blocks, list) and len(blocks) == 2 and "router_offset" in blocks[0]
    offsets = jnp.asarray(0.3 * rng.standard_normal(blocks[0]["router_offset"].shape))
    params = {**params, "blocks": [{**blocks[0], "router_offset": offsets}, blocks[1]]}
    tokens = rng.integers(0, V, (B, T))
    diff = _max_diff(params, tokens, cfg)
    print(f"\nmixed moe/swiglu: max|diff|={diff:.3e}")
    assert diff <= TOL, diff


def test_dense_default_matches_reference():
    cfg = ModelConfig(vocab_size=V, n_layers=2, max_seq_len=16, **ATTN, d_ff=12)
    params = init_params(cfg, key(3), dtype=jnp.float64)
    tokens = np.random.default_rng(3).integers(0, V, (B, T))
    diff = _max_diff(params, tokens, cfg)
    print(f"\ndense: max|diff|={diff:.3e}")
    assert diff <= TOL, diff


@pytest.mark.slow
@pytest.mark.parametrize("mixers, ffns", [(("mamba",), ("none",)), (("mamba", "attn"), ("moe", "swiglu"))])
def test_mamba_and_hybrid_stacks_match_reference(mixers, ffns):
    """Mamba mixers (M20 §19) in the stack: pure Mamba, and a hybrid with attention, MoE and SwiGLU."""
    cfg = ModelConfig(vocab_size=V, n_layers=2, max_seq_len=16, **ATTN, d_ff=12, mixer_pattern=mixers,
                      ffn_pattern=ffns, n_experts=4, moe_top_k=2, moe_d_ff=6, ssm_state=3, ssm_conv=3)
    params = init_params(cfg, key(4), dtype=jnp.float64)
    tokens = np.random.default_rng(4).integers(0, V, (B, T))
    diff = _max_diff(params, tokens, cfg)
    print(f"\n{mixers}/{ffns}: max|diff|={diff:.3e}")
    assert diff <= TOL, diff


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_offsets_steer_selection(router):
    """A large offset on the expert least used at zero offset puts it in every token's set (reference), and
    changes the library's output; reference and library still agree with the large offset."""
    cfg = ModelConfig(vocab_size=V, n_layers=2, max_seq_len=16, **ATTN, ffn_pattern=("moe",), n_experts=8,
                      moe_top_k=2, moe_d_ff=6, router=router)
    params = init_params(cfg, key(5), dtype=jnp.float64)
    tokens = np.random.default_rng(5).integers(0, V, (B, T))

    sel0: dict = {}
    want0 = ref.forward(params, tokens, cfg, selections=sel0)
    counts = np.bincount(np.concatenate([np.ravel(s) for s in sel0.values()]), minlength=cfg.n_experts)
    e = int(np.argmin(counts))
    assert counts[e] < B * T * cfg.n_layers  # not already chosen everywhere: the offset must do the work

    offsets = np.zeros((cfg.n_layers, cfg.n_experts))
    offsets[:, e] = 100.0
    pushed = {**params, "blocks": {**params["blocks"], "router_offset": jnp.asarray(offsets)}}
    sel1: dict = {}
    want1 = ref.forward(pushed, tokens, cfg, selections=sel1)
    assert set(sel1) == set(range(cfg.n_layers))
    assert all(e in s for layer in sel1.values() for s in layer)
    assert float(np.max(np.abs(want1 - want0))) > 1e-6

    got0 = run(params, tokens, cfg)
    got1 = run(pushed, tokens, cfg)
    moved = float(np.max(np.abs(got1 - got0)))
    diff0, diff1 = float(np.max(np.abs(got0 - want0))), float(np.max(np.abs(got1 - want1)))
    print(f"\n{router} offsets: library moved {moved:.3e}; max|diff| {diff0:.3e} (zero), {diff1:.3e} (pushed)")
    assert moved > 1e-6
    assert diff0 <= TOL and diff1 <= TOL, (diff0, diff1)
