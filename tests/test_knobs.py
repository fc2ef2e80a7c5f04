"""The architecture knobs of ModelConfig (the speedrun stacks and Gemma 2/3), each against a direct formula written
here, in value and in gradient three ways (``mlx_llm.gradcheck``: autodiff = central differences, and the direct
formula's jax.grad = autodiff), in every attention path (a path that cannot honour a knob routes to one that
can), in cached decoding (decode = the full forward), in the counts, and off: exactly today's model (float64:
conftest)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_cfg
from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.config import TrainConfig
from mlx_llm.decode.state import forward_cached, init_cache, unstack_layers
from mlx_llm.errors import ConfigError
from mlx_llm.gradcheck import assert_close, check_grads
from mlx_llm.kernels import REFERENCE, Kernels, attention_path
from mlx_llm.kernels.attention import attention as path_attention
from mlx_llm.kernels.loss import chunked_token_nll_lse
from mlx_llm.layers import attention as attention_layer, ffn, layout
from mlx_llm.layers.norm import norm
from mlx_llm.layers.rope_scaling import rope_for
from mlx_llm.model import (Context, apply_layer, embed, hidden_states, layer_list, logits_from_hidden, mtp_hidden,
                           stack_context, training_window)
from mlx_llm.objectives import grads as hand
from mlx_llm.ops import causal_mask, rope, token_nll, window_band
from mlx_llm.scaling.accounting import matmul_params, train_flops_per_token, tree_size
from mlx_llm.train.step import mtp_mean_loss, summed_loss_and_aux

RNG = np.random.default_rng(0)
B, T = 2, 7
KNOBS = dict(attn_softcap=3.0, logit_softcap=4.0, value_embeds=True, unet_skips=True, sandwich_norm=True,
             norm_unit_offset=True, embed_scale=True, rope_local_base=50.0, score_dim=6.0)
# every knob that changes the forward at once: local/global with GeGLU and ReLU² FFNs
ALL = tiny_cfg(n_layers=4, mixer_pattern=("local", "attn"), sliding_window=3, ffn_pattern=("geglu", "relu2"),
               rope_scaling="llama3", rope_factor=4.0, rope_original_max_len=8, **KNOBS)


def moved(params, seed=1, scale=0.3):
    """Every leaf moved off its initial value (gains, gates, skip weights ≠ their constants)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + scale * rng.standard_normal(np.shape(a))), params)


def three_way(f, params, direct, *args, leaves=None):
    """check_grads of f against central differences and against jax.grad of the ``direct`` formula (on ``leaves``,
    default all), and the values equal."""
    assert_close(f(params, *args), direct(params, *args), rel=1e-12)
    check_grads(f, params, *args, analytic=jax.grad(direct), directions=4, leaves=leaves).assert_ok()


def softmax_attention(q, k, v, mask, cap=None, scale_dim=None):
    """The direct formula: S = q·k/√d (or /√s), c·tanh(S/c), −∞ where masked, softmax, A V; GQA by repeating k, v."""
    r = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    s = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(scale_dim or q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v)


# ----- soft caps ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_attention_softcap_value_and_gradient():
    q, k, v = (jnp.asarray(RNG.normal(size=s)) for s in ((B, T, 4, 4), (B, T, 2, 4), (B, T, 2, 4)))
    mask = causal_mask(None, B, T)
    params = {"q": 2 * q, "k": 2 * k, "v": v}  # scores beyond the cap's linear range

    def ours(p):
        return jnp.sum(jnp.sin(path_attention(p["q"], p["k"], p["v"], None, kernels=REFERENCE, cap=3.0)))

    three_way(ours, params, lambda p: jnp.sum(jnp.sin(softmax_attention(p["q"], p["k"], p["v"], mask, 3.0))))
    uncapped = path_attention(params["q"], params["k"], params["v"], None, kernels=REFERENCE)
    assert float(jnp.max(jnp.abs(uncapped - path_attention(params["q"], params["k"], params["v"], None,
                                                           kernels=REFERENCE, cap=3.0)))) > 1e-2  # it acts


@pytest.mark.slow
def test_logit_softcap_value_gradient_and_chunked_loss():
    cfg = tiny_cfg(logit_softcap=2.0)
    h = jnp.asarray(RNG.normal(size=(B, T, 16)))
    params = {"final_norm": jnp.asarray(1 + 0.3 * RNG.normal(size=16)), "embed": jnp.zeros((64, 16)),
              "unembed": jnp.asarray(RNG.normal(size=(16, 64)))}
    y = jnp.asarray(RNG.integers(0, 64, (B, T)))

    def direct(p):
        r = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.norm_eps) * p["final_norm"]
        logits = 2.0 * jnp.tanh(r @ p["unembed"] / 2.0)
        return jnp.sum(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[..., None], -1)[..., 0])

    three_way(lambda p: jnp.sum(token_nll(logits_from_hidden(h, p, cfg), y)), params, direct)
    assert float(jnp.max(jnp.abs(logits_from_hidden(h, params, cfg)))) < 2.0
    r = jnp.asarray(RNG.normal(size=(B, T, 16)))

    def chunked(p):
        nll, lse = chunked_token_nll_lse(r, p["unembed"], y, chunk=3, cap=2.0)
        return jnp.sum(nll) + 0.1 * jnp.sum(lse ** 2)

    def whole(p):
        logits = 2.0 * jnp.tanh(r @ p["unembed"] / 2.0)
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.sum(lse - jnp.take_along_axis(logits, y[..., None], -1)[..., 0]) + 0.1 * jnp.sum(lse ** 2)

    three_way(chunked, {"unembed": params["unembed"]}, whole)


# ----- every attention path honours the cap and the growing window, or routes to one that does -------------------
def test_paths_route_what_they_cannot_honour():
    pallas, splash = (Kernels(attention_impl=i, interpret=True, platform="cpu") for i in ("pallas_gpu", "splash"))
    assert attention_path(pallas, 64) == "pallas_gpu"
    assert attention_path(pallas, 64, cap=3.0) == attention_path(pallas, 64, window=5) == "flash"
    assert attention_path(splash, 64, window=5, cap=3.0) == "splash"  # splash caps and windows itself
    assert attention_path(splash, 64, window=5, growing_window=True) == "flash"  # not a traced window


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["flash", "pallas_gpu", "splash"])
def test_every_path_equals_the_reference_with_cap_and_window(impl):
    """Cap, static window and warmed-up window: values and q/k/v gradients equal the reference path's (float32
    kernels, so to float32 digits)."""
    kernels = Kernels(attention_impl=impl, interpret=impl != "flash", platform="cpu")
    rng = np.random.default_rng(3)
    t = 20
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, t, 4, 8), (B, t, 2, 8), (B, t, 2, 8),
                                                                          (B, t, 4, 8)))
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (B, t)), axis=1), jnp.int32)
    cases = [dict(cap=2.0), dict(cap=2.0, window=6), dict(cap=2.0, window=6, window_now=jnp.int32(3))]
    with jax.enable_x64(impl != "pallas_gpu"):
        for kw in cases:
            def f(q, k, v, kernels, kw=kw):
                return jnp.sum(path_attention(q, k, v, seg, kernels=kernels, **kw) * ct)
            ref, ref_g = jax.value_and_grad(f, (0, 1, 2))(3 * q, 3 * k, v, REFERENCE)
            got, got_g = jax.value_and_grad(f, (0, 1, 2))(3 * q, 3 * k, v, kernels)
            assert abs(float(got - ref)) <= 1e-4 * (1 + abs(float(ref))), kw
            for a, b in zip(got_g, ref_g):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-4 * float(jnp.max(jnp.abs(b))))


def test_window_warmup_schedule_and_band():
    cfg = tiny_cfg(mixer_pattern=("local",), sliding_window=16, window_warmup_steps=10)
    assert cfg.window_warmup_start == 2  # W/8
    assert [int(training_window(cfg, s)) for s in (0, 1, 5, 9, 10, 50)] == [2, 3, 9, 14, 16, 16]
    assert training_window(tiny_cfg(), 3) is None
    q, k, v = (jnp.asarray(RNG.normal(size=s)) for s in ((B, T, 4, 4), (B, T, 2, 4), (B, T, 2, 4)))
    for impl in ("xla", "flash"):
        kernels = Kernels(attention_impl=impl, platform="cpu")
        got = path_attention(q, k, v, None, kernels=kernels, window=5, window_now=jnp.int32(2))
        want = softmax_attention(q, k, v, window_band(causal_mask(None, B, T), 2))
        assert_close(got, want, rel=1e-12, what=impl)


# ----- FFNs, norms, the embedding -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["geglu", "relu2"])
def test_ffn_kinds_value_and_gradient(kind):
    y = jnp.asarray(RNG.normal(size=(B, T, 6)))
    params = {k: jnp.asarray(RNG.normal(size=s)) for k, s in (("w_gate", (6, 5)), ("w_up", (6, 5)), ("w_down", (5, 6)))}
    if kind == "relu2":
        del params["w_gate"]

    def direct(p):
        up = y @ p["w_up"]
        if kind == "relu2":
            return jnp.sum(jnp.sin((jnp.maximum(up, 0) ** 2) @ p["w_down"]))
        a = y @ p["w_gate"]
        gelu = 0.5 * a * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
        return jnp.sum(jnp.sin((gelu * up) @ p["w_down"]))

    three_way(lambda p: jnp.sum(jnp.sin(ffn.ffn(y, p, kind))), params, direct)


@pytest.mark.slow
def test_unit_offset_norm_sandwich_and_embedding_scale():
    cfg = tiny_cfg(d_model=6, norm_unit_offset=True, sandwich_norm=True, embed_scale=True)
    h = jnp.asarray(RNG.normal(size=(B, T, 6)))
    layer = {"ffn_norm": jnp.asarray(0.2 * RNG.normal(size=6)), "post_ffn_norm": jnp.asarray(0.2 * RNG.normal(size=6)),
             "w_gate": jnp.asarray(RNG.normal(size=(6, 5))), "w_up": jnp.asarray(RNG.normal(size=(6, 5))),
             "w_down": jnp.asarray(RNG.normal(size=(5, 6)))}

    def n(x, w):
        return (1 + w) * x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps)

    def direct(p):  # H + N_post(F(N(H))), both gains 1 + w
        y = n(h, p["ffn_norm"])
        f = (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]
        return jnp.sum(jnp.sin(h + n(f, p["post_ffn_norm"])))

    three_way(lambda p: jnp.sum(jnp.sin(ffn.branch(h, p, cfg)[0])), layer, direct)
    assert_close(norm(h, jnp.zeros(6), cfg), h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.norm_eps))
    table = {"embed": jnp.asarray(RNG.normal(size=(64, 6)))}
    ids = jnp.asarray(RNG.integers(0, 64, (B, T)))
    three_way(lambda p: jnp.sum(jnp.sin(embed(p, ids, cfg))), table,
              lambda p: jnp.sum(jnp.sin(math.sqrt(6) * p["embed"][ids])))


# ----- attention: value embeddings, local RoPE base, score scale ------------------------------------------------
@pytest.mark.slow
def test_value_embeddings_local_rope_base_and_score_scale():
    cfg = tiny_cfg(mixer_pattern=("local", "attn"), sliding_window=3, value_embeds=True, rope_local_base=50.0,
                   score_dim=6.0, rope_scaling="linear", rope_scale=0.5)
    layer = moved(jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.key(0))["blocks"][0]))
    h = jnp.asarray(RNG.normal(size=(B, T, 16)))
    ids = jnp.asarray(RNG.integers(0, 64, (B, T)))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    ctx = Context(pos, causal_mask(None, B, T), tokens_BT=ids)

    def direct(p, local):
        x = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.norm_eps) * p["attn_norm"]
        q, k = jnp.einsum("btd,dhk->bthk", x, p["wq"]), jnp.einsum("btd,dgk->btgk", x, p["wk"])
        v = jnp.einsum("btd,dgk->btgk", x, p["wv"]) + p["value_gate"] * p["value_embed"][ids]
        base, scale = (50.0, 1.0) if local else (cfg.rope_base, 0.5)  # local: plain RoPE at its own base
        q, k = rope(q, pos, base, scale), rope(k, pos, base, scale)
        mask = window_band(causal_mask(None, B, T), 3 if local else None)
        o = softmax_attention(q, k, v, mask, scale_dim=6.0)
        return jnp.sum(jnp.sin(h + jnp.einsum("bthk,hkd->btd", o, p["wo"])))

    for local in (True, False):
        three_way(lambda p: jnp.sum(jnp.sin(attention_layer.branch(h, p, cfg, ctx, 3 if local else None))), layer,
                  lambda p: direct(p, local))
    q_local, _ = rope_for(pos, cfg, jnp.ones((B, T, 4, 4)), jnp.ones((B, T, 2, 4)), local=True)
    assert_close(q_local, rope(jnp.ones((B, T, 4, 4)), pos, 50.0))


# ----- the stack: U-net skips, zero-initialised writers, MTP ---------------------------------------------------
@pytest.mark.slow
def test_unet_skips_value_and_gradient():
    cfg = tiny_cfg(n_layers=4, mixer_pattern=("local", "attn"), sliding_window=3, unet_skips=True)
    params = moved(init_params(cfg, jax.random.key(1)))
    ids = jnp.asarray(RNG.integers(0, 64, (B, T)))

    def direct(p):  # layer i ≥ L/2 reads H + w_{i−2}·H_{3−i}
        ctx = stack_context(ids, cfg, REFERENCE)
        h, outs = embed(p, ids), []
        for i, (layer, kinds) in enumerate(layer_list(p, cfg)):
            if i >= 2:
                h = h + p["skip_weights"][i - 2] * outs[3 - i]
            h = apply_layer(h, layer, kinds, cfg, ctx)[0]
            outs.append(h)
        return jnp.sum(jnp.sin(h))

    three_way(lambda p: jnp.sum(jnp.sin(hidden_states(p, ids, cfg))), params, direct,
              leaves=["skip_weights", "blocks/0/wo", "blocks/1/w_down", "embed"])
    with pytest.raises(ConfigError, match="n_layers = 3 must be even"):
        tiny_cfg(n_layers=3, unet_skips=True)


@pytest.mark.slow
def test_zero_init_writers_keep_every_other_draw():
    cfg = tiny_cfg(ffn_pattern=("swiglu", "moe"), n_experts=2, moe_top_k=1, moe_d_ff=4, n_shared_experts=1,
                   mixer_pattern=("attn", "mamba"))
    plain = init_params(cfg, jax.random.key(2))
    zero = init_params(dataclasses.replace(cfg, zero_init_out=True), jax.random.key(2))
    writers = {"wo", "w_down", "expert_down", "shared_down", "out_proj"}
    for path, a in jax.tree_util.tree_leaves_with_path(zero):
        b = plain
        for e in path:
            b = b[getattr(e, "key", getattr(e, "idx", None))]
        if path[-1].key in writers:
            assert np.all(np.asarray(a) == 0) and np.any(np.asarray(b) != 0), path
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.slow
def test_mtp_losses_equal_the_shifted_cross_entropies():
    """DeepSeek-V3's MTP by hand: h'^k = N(h^{k−1}) W_h + N(E[x_{t+k}]) W_e, h^k = Layer_k(h'^k), its logits through
    the shared norm and head score x_{t+k+1}, masked where t+k+1 leaves the window or the document. The training
    loss is the main loss + λ·(mean of the D losses); the main model is the D = 0 model bit for bit."""
    cfg = tiny_cfg(mtp_depth=2)
    params = moved(init_params(cfg, jax.random.key(4)), scale=0.1)
    toks = RNG.integers(0, 64, (B, T + 1))
    seg = jnp.asarray([[0] * 4 + [1] * 3, [0] * 7])
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "mask": jnp.asarray([[1.0] * 6 + [0.0], [1.0] * 7]), "segment_ids": seg,
             "positions": jnp.asarray([[0, 1, 2, 3, 0, 1, 2], list(range(7))])}
    h, ctx = hidden_states(params, batch["tokens"], cfg, positions_BT=batch["positions"],
                           segment_ids_BT=batch["segment_ids"], return_ctx=True)
    kinds = layout.mtp_kinds(cfg)
    losses, h_k, y = [], h, np.asarray(batch["targets"])
    for k in (1, 2):
        layer = jax.tree.map(lambda a: a[k - 1], params["mtp"]["blocks"])
        x_in = np.concatenate([y[:, k - 1:], np.zeros((B, k - 1), int)], axis=1)  # x_{t+k}
        mixed = (norm(h_k, layer["mtp_h_norm"], cfg) @ layer["mtp_h_proj"]
                 + norm(params["embed"][x_in], layer["mtp_e_norm"], cfg) @ layer["mtp_e_proj"])
        h_k = apply_layer(mixed, layer, kinds, cfg, ctx)[0]
        nll = np.asarray(token_nll(logits_from_hidden(h_k, params, cfg),
                                   jnp.asarray(np.concatenate([y[:, k:], np.zeros((B, k), int)], 1))))
        m = np.asarray(batch["mask"])
        valid = np.zeros((B, T))
        for b in range(B):
            for t in range(T - k):
                valid[b, t] = m[b, t + k] * (seg[b, t + k] == seg[b, t])
        losses.append((valid * nll).sum() / valid.sum())
    got = mtp_mean_loss(h, params, batch, cfg, ctx)
    assert_close(got, np.mean(losses), rel=1e-12)
    total, (n, (_, extras)) = summed_loss_and_aux(params, batch, cfg, jnp.float64, mtp_weight=0.3)
    main, (n0, _) = summed_loss_and_aux(params, batch, cfg, jnp.float64)
    assert_close(total / n, main / n0 + 0.3 * np.mean(losses), rel=1e-12)
    assert_close(extras["mtp_loss"] / n, np.mean(losses), rel=1e-12)
    plain = dataclasses.replace(cfg, mtp_depth=0)
    base = init_params(plain, jax.random.key(4))
    with_mtp = init_params(cfg, jax.random.key(4))
    assert set(with_mtp) - set(base) == {"mtp"}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), {k: with_mtp[k] for k in base}, base)
    assert np.asarray(summed_loss_and_aux(base, batch, plain, jnp.float64)[0]) == np.asarray(
        summed_loss_and_aux({k: with_mtp[k] for k in base}, batch, cfg, jnp.float64)[0])
    # decoding reads the main head only: the logits of the model with its modules are the D = 0 model's
    np.testing.assert_array_equal(forward(with_mtp, batch["tokens"], cfg), forward(base, batch["tokens"], plain))
    check_grads(lambda p: mtp_mean_loss(h, p, batch, cfg, ctx), params, directions=2,
                leaves=["mtp/blocks/mtp_h_proj", "mtp/blocks/mtp_e_norm", "embed"]).assert_ok()


# ----- the whole model with every knob: decode = forward, counts = the tree, off = today ---------------------------
@pytest.mark.slow
def test_cached_decoding_equals_the_full_forward_with_every_knob():
    params = moved(init_params(ALL, jax.random.key(5)), scale=0.1)
    ids = RNG.integers(0, 64, (B, 12))
    want = np.asarray(forward(params, ids, ALL))
    cache = init_cache(ALL, B, 12, jnp.float64)
    got, cache = forward_cached(params, ids[:, :5], cache, ALL)  # a prefill longer than the window, then steps
    rows = [np.asarray(got)]
    step = jax.jit(lambda p, layers, ids, cache: forward_cached(p, ids, cache, ALL, layers=layers))
    layers = unstack_layers(params, ALL)
    for t in range(5, 12):
        logits, cache = step(params, layers, ids[:, t:t + 1], cache)
        rows.append(np.asarray(logits))
    assert_close(np.concatenate(rows, axis=1), want, rel=1e-10)
    assert float(np.max(np.abs(want))) < ALL.logit_softcap


def test_counts_follow_the_declarations():
    cfg = dataclasses.replace(ALL, mtp_depth=2)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert tree_size(params) == cfg.param_count()
    assert layout.param_shapes(cfg) == jax.tree.map(lambda a: tuple(a.shape), params)
    d, m, V = 16, 32, 64
    attn = 2 * d * 16 + 2 * d * 8  # q, o (4 heads of 4) and k, v (2 of 4)
    assert matmul_params(ALL) == V * d + 4 * attn + 2 * (3 * d * m) + 2 * (2 * d * m)  # GeGLU 3dm, ReLU² 2dm
    extra = 2 * (2 * d * d + attn + 2 * d * m + V * d)  # D modules: projection, a layer of the last kinds, a head
    assert matmul_params(cfg) == matmul_params(ALL) + extra
    keys = (T + 1) / 2
    assert train_flops_per_token(cfg, T, causal=True) - train_flops_per_token(ALL, T, causal=True) == \
        pytest.approx(6 * extra + 2 * 12 * keys * 16)
    assert cfg.non_embedding_param_count() == cfg.param_count() - V * d * 2 - 6 * V * 8  # tables: E, U, 6 value


def test_knobs_off_is_todays_model_and_bad_values_are_refused():
    for name, value in (("attn_softcap", 0.0), ("logit_softcap", -1.0), ("score_dim", 0)):
        with pytest.raises(ConfigError, match=name):
            tiny_cfg(**{name: value})
    for kw, message in ((dict(rope_local_base=10.0), "sliding-window"), (dict(window_warmup_steps=5), "'local'"),
                        (dict(window_warmup_start=2), "window_warmup_steps = 0"),
                        (dict(mixer_pattern=("mamba",), ffn_pattern=("none",), sandwich_norm=True), "Mamba")):
        with pytest.raises(ConfigError, match=message):
            tiny_cfg(**kw)
    with pytest.raises(ConfigError, match="mtp_weight = 0.5 .* no MTP modules"):
        from mlx_llm.config import check_seq_len
        check_seq_len(tiny_cfg(), TrainConfig(mtp_weight=0.5, seq_len=16))
    with pytest.raises(ConfigError, match="hand-written backward covers .* logit_softcap = 4.0"):
        hand.analytic_grad(init_params(ALL, jax.random.key(0)), np.zeros((1, 3), int), np.zeros((1, 3), int),
                           np.ones((1, 3)), ALL)
    off = ModelConfig(**{**tiny_cfg().to_dict()})
    assert off == tiny_cfg() and all(getattr(off, k) in (None, False, 0) for k in KNOBS)


# ----- through the command line: a run with knobs logs mtp_loss; a refused one writes nothing ---------------------
@pytest.mark.slow
def test_a_run_with_knobs_logs_the_mtp_loss_and_a_refused_one_writes_nothing(corpus_dir, tmp_path):
    import json

    from helpers import TINY, cli_in_process, snapshot

    TINY.to_json(tmp_path / "model.json")
    common = ("--config", tmp_path / "model.json", "--data", corpus_dir, "--extensions", ".py", "--tokenizer", "byte",
              "--val-percent", 20, "--batch-size", 4, "--seq-len", 32, "--eval-tokens", 128, "--log-interval", 1,
              "--no-progress", "--sample-tokens", 4, "--cache-dir", tmp_path / "cache", "--warmup-steps", 1,
              "--steps", 2)
    before = snapshot(tmp_path)
    for flags, message in ((("--mtp-weight", 0.5), "mtp_weight = 0.5 weighs"),
                           (("--polar-express", "--optimizer", "adamw"), "polar_express = true replaces"),
                           (("--set", "model.attn_softcap=0"), "attn_softcap = 0"),
                           (("--set", "model.window_warmup_steps=3"), "window_warmup_steps = 3")):
        proc = cli_in_process("train", "--out", tmp_path / "refused", *common, *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert snapshot(tmp_path) == before and not (tmp_path / "refused").exists()
    run = tmp_path / "run"
    proc = cli_in_process("train", "--out", run, *common, "--set", "model.mtp_depth=1", "--set",
                          "model.logit_softcap=30", "--optimizer", "normuon", "--polar-express", "--cautious-wd",
                          "--scalar-lr-scale", 2, "--mtp-weight", 0.5)
    assert proc.returncode == 0, proc.stderr
    assert ModelConfig.from_json(run / "config.json").mtp_depth == 1
    tcfg = TrainConfig.from_json(run / "train_config.json")
    assert (tcfg.optimizer, tcfg.polar_express, tcfg.cautious_wd, tcfg.scalar_lr_scale, tcfg.mtp_weight) == \
        ("normuon", True, True, 2.0, 0.5)
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 2
    for r in steps:  # loss = main + λ·mtp_loss, both near ln 263 ≈ 5.6 at the start
        assert 4 < r["mtp_loss"] < 7 and r["loss"] > 0.5 * r["mtp_loss"] + 4, r
