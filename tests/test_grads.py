"""M20 §11: the hand-derived backward (mlx_llm.objectives.grads) against jax.vjp / jax.grad and central differences."""

import ast
import functools
import importlib
import inspect
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

jax.config.update("jax_enable_x64", True)

from mlx_llm import examples, init_params, ops  # noqa: E402
from mlx_llm.objectives import grads  # noqa: E402
from mlx_llm.config import ModelConfig  # noqa: E402
from mlx_llm.errors import InputError  # noqa: E402
from mlx_llm.objectives.loss import masked_cross_entropy  # noqa: E402
from mlx_llm.model import block, embed, forward  # noqa: E402
from mlx_llm.gradcheck import assert_close, assert_trees_close, quick_jit as jit  # noqa: E402



def rand(seed, shape, scale=1.0):
    """Float64 test inputs from NumPy (eager jax.random would compile a kernel per shape)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape))


# init_params compiled once per config instead of op by op.
init_params_f64 = jit(lambda cfg, key: init_params(cfg, key, dtype=jnp.float64), static_argnums=0)


def loss_fn(params, tokens, targets, mask, cfg, **kw):
    return masked_cross_entropy(forward(params, tokens, cfg, **kw), targets, mask)


def as_jax(tree):
    return jax.tree.map(jnp.asarray, tree)


# Compiled once per (config, shapes) and shared by every test: eager op-by-op dispatch is slow on 2 cores.
REF_VALUE_AND_GRAD = jit(jax.value_and_grad(loss_fn), static_argnums=4)
ANALYTIC = jit(grads.analytic_value_and_grad, static_argnums=4)


def vjp_of(f, *args):
    """The pullback of ``f`` at ``args``, compiled (jax.vjp is the reference these tests compare to)."""
    pullback = jit(lambda args, g: jax.vjp(f, *args)[1](g))
    return lambda g: pullback(args, g)


@functools.lru_cache(maxsize=None)
def running(tie: bool):
    cfg, params, tokens, targets = examples.running_example(tie_embeddings=tie)
    return cfg, as_jax(params), jnp.asarray(tokens), jnp.asarray(targets), jnp.ones(tokens.shape, bool)


# ----- 0. no autodiff inside objectives/grads/ -------------------------------------------------------------

def test_grads_module_uses_no_autodiff():
    """Every module of the grads package (objectives/grads/*.py)."""
    modules = [importlib.import_module(f"{grads.__name__}.{m.name}") for m in pkgutil.iter_modules(grads.__path__)]
    assert len(modules) >= 6
    for module in [grads, *modules]:
        tree = ast.parse(inspect.getsource(module))
        banned = {"grad", "vjp", "jvp", "value_and_grad", "linearize", "linear_transpose", "custom_vjp"}
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not used & banned, (module.__name__, used & banned)


# ----- 1. each op's backward against jax.vjp of the forward op ---------------------------------------

def test_cross_entropy_backward_matches_grad():
    keys = range(0, 2)
    logits = rand(keys[0], (2, 5, 7), 2.0)
    targets = jnp.asarray(np.random.default_rng(keys[1]).integers(0, 7, (2, 5)))
    mask = jnp.array([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]])
    want = jit(jax.grad(masked_cross_entropy))(logits, targets, mask)
    assert_close(jit(grads.cross_entropy_backward)(logits, targets, mask), want)


def test_linear_backward_matches_vjp():
    keys = range(10, 13)
    x, w, g = rand(keys[0], (2, 3, 4)), rand(keys[1], (4, 5)), rand(keys[2], (2, 3, 5))
    vjp = vjp_of(lambda x, w: x @ w, x, w)
    for got, want in zip(jit(grads.linear_backward)(x, w, g), vjp(g)):
        assert_close(got, want)


def test_rms_norm_backward_matches_vjp_with_large_eps():
    keys = range(20, 23)
    h, gamma, g = rand(keys[0], (2, 3, 6)), rand(keys[1], (6,)), rand(keys[2], (2, 3, 6))
    for eps in (1e-6, 0.5):  # a large ε shows that ρ must keep ε in the backward too
        vjp = vjp_of(lambda h, gamma: ops.rms_norm(h, gamma, eps), h, gamma)
        for got, want in zip(jit(grads.rms_norm_backward, static_argnums=2)(h, gamma, eps, g), vjp(g)):
            assert_close(got, want, what=f"eps={eps}")


def test_softmax_backward_matches_vjp():
    keys = range(30, 32)
    s, g = rand(keys[0], (3, 4, 6), 3.0), rand(keys[1], (3, 4, 6))
    a = jit(ops.softmax)(s)
    assert_close(jit(grads.softmax_backward)(a, g), vjp_of(ops.softmax, s)(g)[0])


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_rope_backward_is_the_inverse_rotation(scale):
    keys = range(40, 42)
    x, g = rand(keys[0], (2, 5, 3, 8)), rand(keys[1], (2, 5, 3, 8))
    positions = jnp.array([[0, 1, 2, 3, 4], [3, 7, 0, 1, 2]])
    vjp = vjp_of(lambda x: ops.rope(x, positions, 100.0, scale), x)
    backward = jit(lambda g: grads.rope_backward(g, positions, 100.0, scale))
    assert_close(backward(g), vjp(g)[0])
    assert_close(backward(jit(ops.rope, static_argnums=(2, 3))(x, positions, 100.0, scale)), x)


@pytest.mark.parametrize("segments", [False, True])
def test_attention_backward_gqa_matches_vjp(segments):
    b, t, h, g, k = 2, 5, 4, 2, 4
    keys = range(50, 54)
    q, kk, v = rand(keys[0], (b, t, h, k)), rand(keys[1], (b, t, g, k)), rand(keys[2], (b, t, g, k))
    g_o = rand(keys[3], (b, t, h, k))
    seg = jnp.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]) if segments else None
    mask = ops.causal_mask(seg, b, t)
    vjp = vjp_of(lambda q, kk, v: ops.attention(q, kk, v, mask), q, kk, v)
    for got, want, name in zip(jit(grads.attention_backward)(q, kk, v, mask, g_o), vjp(g_o), "QKV"):
        assert_close(got, want, what=name)


def test_swiglu_backward_matches_vjp():
    keys = range(60, 65)
    y, g = rand(keys[0], (2, 3, 4), 2.0), rand(keys[1], (2, 3, 4))
    wg, wu, wd = rand(keys[2], (4, 5)), rand(keys[3], (4, 5)), rand(keys[4], (5, 4))
    vjp = vjp_of(ops.swiglu, y, wg, wu, wd)
    got_all = jit(grads.swiglu_backward)(y, wg, wu, wd, g)
    for got, want, name in zip(got_all, vjp(g), ["Y", "gate", "up", "down"]):
        assert_close(got, want, what=name)


def test_embedding_backward_accumulates_repeated_ids():
    table = rand(7, (6, 3))
    tokens = jnp.array([[1, 4, 1, 1], [0, 4, 2, 1]])  # id 1 four times, id 4 twice, 3 and 5 never
    g = rand(8, (2, 4, 3))
    vjp = vjp_of(lambda e: embed({"embed": e}, tokens), table)
    got = np.asarray(grads.embedding_backward(tokens, g, 6))
    assert_close(got, vjp(g)[0])
    assert_close(got[1], g[0, 0] + g[0, 2] + g[0, 3] + g[1, 3])
    assert np.all(got[[3, 5]] == 0.0)


def test_block_backward_matches_vjp():
    cfg = ModelConfig(vocab_size=7, d_model=6, n_layers=1, n_heads=4, n_kv_heads=2, d_head=4, d_ff=5,
                      max_seq_len=8, rope_base=50.0)
    layer = jax.tree.map(lambda a: a[0], init_params_f64(cfg, jax.random.key(9))["blocks"])
    keys = range(100, 102)
    h, g_out = rand(keys[0], (2, 5, 6)), rand(keys[1], (2, 5, 6))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    mask = ops.causal_mask(None, 2, 5)
    want_h, want_layer = vjp_of(lambda h, layer: block(h, layer, cfg, positions, mask), h, layer)(g_out)

    @jit
    def analytic(h, layer, g_out):
        _, tape = grads.block_forward(h, layer, cfg, positions, mask)
        return grads.block_backward(tape, layer, cfg, positions, mask, g_out)

    got_h, got_layer = analytic(h, layer, g_out)
    assert_close(got_h, want_h, what="G_H")
    assert_trees_close(got_layer, want_layer)


# ----- 2. analytic_grad == jax.grad on whole models --------------------------------------------------

def check_model(cfg, params, tokens, targets, mask, **kw):
    want_loss, want = REF_VALUE_AND_GRAD(params, tokens, targets, mask, cfg, **kw)
    got_loss, got = ANALYTIC(params, tokens, targets, mask, cfg, **kw)
    assert_close(got_loss, want_loss, what="loss")
    assert_trees_close(got, want)
    return got


@pytest.mark.parametrize("tie, n_params", [(False, 50), (True, 42)])
def test_running_example_matches_jax_grad(tie, n_params):
    cfg, params, tokens, targets, mask = running(tie)
    got = check_model(cfg, params, tokens, targets, mask)
    assert ravel_pytree(got)[0].size == n_params == cfg.param_count()


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_second_configuration_matches_jax_grad(n_kv_heads):
    cfg, params, tokens, targets = examples.second_configuration(n_kv_heads)
    check_model(cfg, as_jax(params), jnp.asarray(tokens), jnp.asarray(targets), jnp.ones(tokens.shape, bool))


def random_model(seed, **overrides):
    """L=3, GQA 4/2, d_head·n_heads ≠ d_model, batch 2, repeated ids, partial loss mask, non-unit gains."""
    fields = dict(vocab_size=5, d_model=6, n_layers=3, n_heads=4, n_kv_heads=2, d_head=4, d_ff=5,
                  max_seq_len=8, rope_base=20.0)
    cfg = ModelConfig(**{**fields, **overrides})
    keys = range(10 * seed, 10 * seed + 4)
    params = init_params_f64(cfg, jax.random.key(seed))
    for name in ("attn_norm", "ffn_norm"):
        params["blocks"][name] = params["blocks"][name] + rand(keys[1], params["blocks"][name].shape, 0.3)
    params["final_norm"] = params["final_norm"] + rand(keys[2], (cfg.d_model,), 0.3)
    tokens = jnp.array([[1, 3, 1, 1, 4, 0], [2, 2, 0, 3, 2, 1]])
    targets = jnp.asarray(np.random.default_rng(keys[3]).integers(0, cfg.vocab_size, tokens.shape))
    mask = jnp.array([[0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 0, 1]])
    return cfg, params, tokens, targets, mask


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"rope_scale": 0.5}],
                         ids=["untied", "tied", "rope_scale"])
def test_random_deep_gqa_model_matches_jax_grad(overrides):
    check_model(*random_model(11, **overrides))


@pytest.mark.slow
def test_packed_segments_and_positions_match_jax_grad():
    cfg, params, tokens, targets, mask = random_model(12, rope_scale=0.5)
    segment_ids = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    positions = jnp.array([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    check_model(cfg, params, tokens, targets, mask, positions_BT=positions, segment_ids_BT=segment_ids)


def test_empty_loss_mask_and_bad_ids_are_rejected():
    cfg, params, tokens, targets, mask = running(False)
    with pytest.raises(InputError, match="selects no target"):
        grads.analytic_grad(params, tokens, targets, jnp.zeros_like(mask), cfg)
    with pytest.raises(InputError, match=r"tokens\[0, 1\] = 4 is not a valid token id"):
        grads.analytic_grad(params, jnp.array([[0, 4, 2]]), targets, mask, cfg)


# ----- 3. central differences on every parameter of the running example (M20 §11) -------------------

@pytest.mark.parametrize("tie, n_params", [(False, 50), (True, 42)])
def test_central_differences_agree_on_every_parameter(tie, n_params):
    cfg, params, tokens, targets, mask = running(tie)
    theta, unravel = ravel_pytree(params)
    assert theta.size == n_params
    h = 1e-5
    steps = h * jnp.eye(theta.size)
    batched_loss = jit(jax.vmap(lambda th: loss_fn(unravel(th), tokens, targets, mask, cfg)))
    fd = (batched_loss(theta + steps) - batched_loss(theta - steps)) / (2 * h)
    analytic, _ = ravel_pytree(ANALYTIC(params, tokens, targets, mask, cfg)[1])
    np.testing.assert_allclose(np.asarray(analytic), np.asarray(fd), rtol=1e-7, atol=1e-7)
    assert np.count_nonzero(np.asarray(analytic)) > 0.8 * n_params  # the check is not vacuous


# ----- 4–5. the seed's numbers ----------------------------------------------------------------------

def test_final_row_logit_gradient_matches_m20():
    cfg, params, tokens, targets, mask = running(False)
    g_logits = grads.cross_entropy_backward(forward(params, tokens, cfg), targets, mask)
    np.testing.assert_allclose(np.asarray(g_logits[0, -1]), [0.082722, 0.100724, 0.088719, -0.272166],
                               atol=5e-7)
    assert abs(float(jnp.sum(g_logits[0, -1]))) < 1e-15  # invariance to a common logit shift


def test_running_example_gradient_norm_matches_m20():
    cfg, params, tokens, targets, mask = running(False)
    loss, g = ANALYTIC(params, tokens, targets, mask, cfg)
    assert abs(float(loss) - 1.109373924) < 5e-10
    norm = float(jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))))
    assert abs(norm - 0.587186334) < 5e-10
