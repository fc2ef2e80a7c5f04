"""Mamba layers in the stack (M20 §19): configs, counts, hybrids, and decoding with the SSM state as carry."""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mlx_llm import ModelConfig, forward, generate, init_params  # noqa: E402
from mlx_llm.decode.state import forward_cached, init_cache  # noqa: E402
from mlx_llm.errors import ConfigError  # noqa: E402
from mlx_llm.model import Context, apply_layer, embed, layer_list, logits_from_hidden  # noqa: E402
from mlx_llm.ops import causal_mask  # noqa: E402

BASE = dict(vocab_size=11, d_model=8, max_seq_len=32, ssm_state=3, ssm_conv=3, ssm_expand=2)
PURE = ModelConfig(**BASE, n_layers=2, mixer_pattern=("mamba",), ffn_pattern=("none",), tie_embeddings=True)
HYBRID = ModelConfig(**BASE, n_layers=4, mixer_pattern=("mamba", "attn"), ffn_pattern=("swiglu",), n_heads=2,
                     n_kv_heads=1, d_head=4, d_ff=12)
HYBRID_MOE = ModelConfig(**BASE, n_layers=3, mixer_pattern=("mamba", "mamba", "attn"), ffn_pattern=("moe",),
                         n_heads=2, n_kv_heads=2, d_head=4, n_experts=4, moe_top_k=2, moe_d_ff=6)
CONFIGS = {"pure": PURE, "hybrid-moe": HYBRID_MOE}  # (HYBRID: the same code paths, kept for users to try)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    cfg = CONFIGS[request.param]
    return cfg, init_params(cfg, jax.random.key(0), jnp.float64)


def test_counts_and_layout(model):
    cfg, params = model
    assert sum(a.size for a in jax.tree.leaves(params)) == cfg.param_count() + cfg.routing_state_count()
    d, i, n, w, r = 8, 16, 3, 3, 1
    assert cfg.ssm_dt_rank == r  # ⌈d/16⌉
    assert cfg.mamba_param_count() == d + 2 * d * i + w * i + i + 2 * i * r + i + 3 * i * n + i + i * d
    mamba_layer = next(layer for layer, kinds in layer_list(params, cfg) if kinds[0] == "mamba")
    ffn_keys = {"ffn_norm", "w_gate", "w_up", "w_down", "router", "router_offset", "expert_gate", "expert_up",
                "expert_down"}
    assert {k: v.shape for k, v in mamba_layer.items() if k not in ffn_keys} == {
        "ssm_norm": (d,), "in_x": (d, i), "in_z": (d, i), "conv_w": (w, i), "conv_b": (i,), "w_dt": (i, r),
        "w_B": (i, n), "w_C": (i, n), "dt_proj": (r, i), "dt_bias": (i,), "A_log": (i, n), "D": (i,),
        "out_proj": (i, d)}


@pytest.mark.slow
def test_stack_equals_layers_run_one_by_one(model):
    cfg, params = model
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 11)
    ctx = Context(jnp.broadcast_to(jnp.arange(9), (2, 9)), causal_mask(None, 2, 9))
    h = embed(params, tokens)
    for layer, kinds in layer_list(params, cfg):
        h, _ = apply_layer(h, layer, kinds, cfg, ctx)
    np.testing.assert_allclose(forward(params, tokens, cfg), logits_from_hidden(h, params, cfg), atol=1e-12)


@pytest.mark.slow
def test_cached_decoding_equals_full_forward(model):
    """Prefill of 5, then chunks of 2 and 1 token: the same logits as one full forward (float64 ≤ 1e-10)."""
    cfg, params = model
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 11)
    full = forward(params, tokens, cfg)
    state = init_cache(cfg, 2, 16, jnp.float64)
    out = []
    for a, b in ((0, 5), (5, 7), (7, 8), (8, 9)):
        logits, state = forward_cached(params, tokens[:, a:b], state, cfg)
        out.append(logits)
    np.testing.assert_allclose(jnp.concatenate(out, axis=1), full, atol=1e-10)
    assert state.lengths.tolist() == [9, 9]


@pytest.mark.slow
def test_ragged_prompts_equal_each_prompt_alone(model):
    cfg, params = model
    prompt = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    both = generate(params, cfg, prompt, 4, prompt_lengths=[5, 3])
    alone = [generate(params, cfg, prompt[i:i + 1, :n], 4).tokens[0] for i, n in enumerate((5, 3))]
    assert both.tokens.tolist() == [a.tolist() for a in alone]


@pytest.mark.slow
def test_greedy_and_beam_decode(model):
    cfg, params = model
    prompt = jnp.array([[3, 1, 4]])
    out = generate(params, cfg, prompt, 5)
    seq = prompt
    for _ in range(5):
        seq = jnp.concatenate([seq, jnp.argmax(forward(params, seq, cfg)[:, -1], -1)[:, None]], axis=1)
    assert out.tokens[0].tolist() == seq[0, 3:].tolist()
    beam = generate(params, cfg, prompt, 5, beam_width=3)
    logp = jax.nn.log_softmax(forward(params, jnp.concatenate([prompt, beam.tokens], 1), cfg)[0, 2:-1])
    want = float(jnp.sum(jnp.take_along_axis(logp, beam.tokens[0][:, None], axis=1)))
    assert float(beam.logp[0]) == pytest.approx(want, abs=1e-9)  # the beam's score is its real log-probability
    assert float(beam.logp[0]) >= float(out.logp[0]) - 1e-9  # and no worse than greedy


def test_state_bytes_do_not_grow_with_the_context():
    small, large = init_cache(PURE, 1, 8), init_cache(PURE, 1, 4096)
    assert small.conv.shape == large.conv.shape == (2, 1, 2, 16) and small.ssm.shape == (2, 1, 16, 3)
    assert small.k.shape[0] == 0  # no attention layer, no K/V cache


@pytest.mark.parametrize("change, message", [
    (dict(mixer_pattern=("mamba", "rnn")), r"mixer_pattern = \['mamba', 'rnn'\] has unknown kind\(s\) \['rnn'\]"),
    (dict(ssm_state=0), r"ssm_state = 0 is invalid: it must be a positive integer"),
    (dict(ssm_conv=0), r"ssm_conv = 0 is invalid: it must be a positive integer"),
    (dict(ssm_dt_rank=-1), r"ssm_dt_rank = -1 is invalid"),
    (dict(ssm_scan="parallel"), r"ssm_scan = 'parallel' is invalid: valid scans are \['fused', 'associative', 'chunked', 'auto'\]"),
    (dict(n_layers=3, mixer_pattern=("mamba", "attn"), n_heads=2, n_kv_heads=1, d_head=4),
     r"n_layers = 3 is not a multiple of the stack's period 2"),
    (dict(mixer_pattern=("mamba", "attn")), r"n_heads is not set: layers of kind 'attn' need it"),
])
def test_bad_mamba_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, "n_layers": 2, "mixer_pattern": ("mamba",), "ffn_pattern": ("none",), **change})


def test_decode_state_bytes_match_the_allocated_state():
    from mlx_llm.scaling.accounting import decode_state_bytes, kv_cache_bytes, ssm_state_scalars

    for cfg in (PURE, HYBRID, HYBRID_MOE):
        for t in (8, 64):
            state = init_cache(cfg, 2, t)
            allocated = sum(a.size * a.dtype.itemsize for a in (state.k, state.v, state.conv, state.ssm))
            assert decode_state_bytes(cfg, t, 2) == allocated
    assert kv_cache_bytes(PURE, 4096) == 0 and ssm_state_scalars(PURE) == 2 * (2 * 16 + 16 * 3)
    assert kv_cache_bytes(HYBRID, 10) == 2 * 2 * 10 * 1 * 4 * 4  # 2 attention layers of the 4


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone():
    """Segment ids reset the SSM state and the conv window at a document start (and attention stays within)."""
    cfg = HYBRID
    params = init_params(cfg, jax.random.key(3), jnp.float64)
    doc1, doc2 = [1, 2, 3, 4, 5], [6, 7, 8]
    packed = forward(params, jnp.array([doc1 + doc2]), cfg, segment_ids_BT=jnp.array([[0] * 5 + [1] * 3]),
                     positions_BT=jnp.array([list(range(5)) + list(range(3))]))
    np.testing.assert_allclose(packed[0, :5], forward(params, jnp.array([doc1]), cfg)[0], atol=1e-12)
    np.testing.assert_allclose(packed[0, 5:], forward(params, jnp.array([doc2]), cfg)[0], atol=1e-12)


@pytest.mark.slow
def test_float32_cached_decoding_equals_full_forward():
    cfg = HYBRID_MOE
    params = init_params(cfg, jax.random.key(4), jnp.float32)
    tokens = jax.random.randint(jax.random.key(5), (1, 7), 0, 11)
    state = init_cache(cfg, 1, 8, jnp.float32)
    a, state = forward_cached(params, tokens[:, :4], state, cfg)
    b, state = forward_cached(params, tokens[:, 4:], state, cfg)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), forward(params, tokens, cfg), atol=1e-5)
