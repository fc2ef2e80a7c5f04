"""The whole model's backward by hand (M20 §11 composed over M20 §20's expression), for every ``ModelConfig``.

Forward with tapes: H⁽⁰⁾ = E[x], each layer's mixer branch (attention, sliding-window attention or Mamba) and FFN
branch (SwiGLU, MoE or none) in stack order, R = N_γo(H⁽ᴸ⁾), U the output projection (Eᵀ when tied). A head turns
(R, U) into the loss and its G_R, G_U: the next-token loss with or without z-loss, dense or chunked, or the
masked-diffusion NELBO. Backward in reverse order: γ_o, the layers from last to first (FFN then mixer), the
embedding scatter-add, and with tied embeddings the output role's G_Uᵀ added to the same table. The layer
gradients are stacked back into the layout of ``params["blocks"]`` (one dict stacked over L, or a list of P).
LoRA adapters get theirs by the chain rule through W = W₀ + (α/r)·A·B (``lora_backward``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm import lora as lora_lib
from mlx_llm.config import ATTENTION_KINDS, ModelConfig
from mlx_llm.errors import ConfigError
from mlx_llm.model import check_tokens, embed, layer_list, unembed_matrix
from mlx_llm.objectives.grads.blocks import (attention_branch_backward, attention_branch_forward, moe_branch_forward,
                                             swiglu_branch_backward, swiglu_branch_forward)
from mlx_llm.objectives.grads.losses import chunked_lm_loss_and_backward, lm_loss_and_backward, nelbo_loss_and_backward
from mlx_llm.objectives.grads.mamba import mamba_branch_backward, mamba_branch_forward
from mlx_llm.objectives.grads.moe import moe_branch_backward
from mlx_llm.objectives.grads.primitives import _acc, embedding_backward, linear_backward, rms_norm_backward
from mlx_llm.objectives.loss import check_loss_mask
from mlx_llm.ops import causal_mask, document_mask, rms_norm, window_band


# ----- one layer -------------------------------------------------------------------------------------------------
def layer_forward(h_BTD, layer, kinds, cfg: ModelConfig, positions_BT, mask_BTS, segment_ids_BT):
    """``model.apply_layer`` with tapes: the mixer branch, then the FFN branch. Returns (H', (mixer tape, FFN tape))."""
    mixer, ffn = kinds
    if mixer in ATTENTION_KINDS:
        h_BTD, mixer_tape = attention_branch_forward(h_BTD, layer, cfg, positions_BT,
                                                     window_band(mask_BTS, cfg.window(mixer)))
    else:
        h_BTD, mixer_tape = mamba_branch_forward(h_BTD, layer, cfg, segment_ids_BT)
    ffn_tape = None
    if ffn == "swiglu":
        h_BTD, ffn_tape = swiglu_branch_forward(h_BTD, layer, cfg)
    elif ffn == "moe":
        h_BTD, ffn_tape = moe_branch_forward(h_BTD, layer, cfg)
    return h_BTD, (mixer_tape, ffn_tape)


def layer_backward(tape, layer, kinds, cfg: ModelConfig, positions_BT, mask_BTS, segment_ids_BT, g_out_BTD):
    """One layer sent back: the FFN branch (if any), then the mixer branch. Returns (G_H, grads of every key)."""
    (mixer, ffn), (mixer_tape, ffn_tape) = kinds, tape
    grads = {}
    if ffn == "swiglu":
        g_out_BTD, grads = swiglu_branch_backward(ffn_tape, layer, cfg, g_out_BTD)
    elif ffn == "moe":
        g_out_BTD, grads = moe_branch_backward(ffn_tape, layer, cfg, g_out_BTD)
    if mixer in ATTENTION_KINDS:
        g_h_BTD, grads_mixer = attention_branch_backward(mixer_tape, layer, cfg, positions_BT,
                                                         window_band(mask_BTS, cfg.window(mixer)), g_out_BTD)
    else:
        g_h_BTD, grads_mixer = mamba_branch_backward(mixer_tape, layer, cfg, segment_ids_BT, g_out_BTD)
    return g_h_BTD, {**grads_mixer, **grads}


def restack(per_layer: list, cfg: ModelConfig):
    """Per-layer gradient dicts in the layout of ``params["blocks"]``: one dict stacked over L (uniform), or a list
    of P dicts, entry j stacking layers j, j + P, … (the inverse of ``model.layer_list``)."""
    groups = [jax.tree.map(lambda *a: jnp.stack(a), *per_layer[j::cfg.period]) for j in range(cfg.period)]
    return groups[0] if cfg.uniform else groups


# ----- the stack and a head ----------------------------------------------------------------------------------------
# ModelConfig fields (at their off value) whose equations the hand backward does not have: their gradients come
# from jax.grad, and each knob's equation is checked against a direct formula in its own tests (test_knobs.py).
NOT_BY_HAND = {"attn_softcap": None, "logit_softcap": None, "value_embeds": False, "unet_skips": False,
               "sandwich_norm": False, "norm_unit_offset": False, "embed_scale": False, "rope_local_base": None,
               "score_dim": None, "mtp_depth": 0}
BY_HAND_FFNS = ("swiglu", "moe", "none")


def check_by_hand(cfg: ModelConfig) -> None:
    """Refuse, by name, a config whose forward has terms the hand backward does not write out (rather than give
    the gradient of another model). ``zero_init_out`` and the window warmup change no equation of a forward."""
    knobs = [f"{k} = {getattr(cfg, k)!r}" for k, off in NOT_BY_HAND.items() if getattr(cfg, k) != off]
    ffns = sorted(set(cfg.ffn_pattern) - set(BY_HAND_FFNS))
    if knobs or ffns:
        what = ", ".join(knobs + [f"FFN kind(s) {ffns}"] * bool(ffns))
        raise ConfigError(f"the hand-written backward covers the M20 stack and its variants, not {what}: use "
                          f"jax.grad for this config (its knobs are checked against direct formulas instead)")


def value_and_grad_with_head(params, tokens_BT, cfg: ModelConfig, head, *, positions_BT=None, segment_ids_BT=None):
    """(loss, grads) of ``head`` on the model's final rows: ``head(R, U)`` → (loss, G_R, G_U). The forward keeps
    one tape per layer; the backward runs the module docstring's order. ``grads`` is shaped like ``params``.
    Configs with terms it has no equations for are refused (``check_by_hand``)."""
    check_by_hand(cfg)
    check_tokens(tokens_BT, cfg)
    if cfg.parametrization != "sp":
        raise ConfigError(f"the analytic backward is written for the standard parametrization; this config is "
                          f"parametrization = {cfg.parametrization!r} (use jax.grad)")
    params, tokens_BT = jax.tree.map(jnp.asarray, params), jnp.asarray(tokens_BT)
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions_BT is None else jnp.asarray(positions_BT)
    mask_BTS = (causal_mask if cfg.causal else document_mask)(segment_ids_BT, b, t) if cfg.attention else None
    layers = layer_list(params, cfg)
    h_BTD, tapes = embed(params, tokens_BT), []
    for layer, kinds in layers:
        h_BTD, tape = layer_forward(h_BTD, layer, kinds, cfg, positions_BT, mask_BTS, segment_ids_BT)
        tapes.append(tape)
    r_BTD = rms_norm(h_BTD, params["final_norm"], cfg.norm_eps)
    u_DV = unembed_matrix(params, cfg)
    loss, g_r, g_u = head(r_BTD, u_DV)
    g_h, g_final_norm = rms_norm_backward(h_BTD, params["final_norm"], cfg.norm_eps, g_r)
    per_layer = [None] * len(layers)
    for index in reversed(range(len(layers))):
        layer, kinds = layers[index]
        g_h, per_layer[index] = layer_backward(tapes[index], layer, kinds, cfg, positions_BT, mask_BTS,
                                               segment_ids_BT, g_h)
    grads = {"embed": embedding_backward(tokens_BT, g_h, cfg.vocab_size), "blocks": restack(per_layer, cfg),
             "final_norm": g_final_norm}
    if cfg.tie_embeddings:
        grads["embed"] = grads["embed"] + g_u.T  # one table, two roles: lookup and output projection
    else:
        grads["unembed"] = g_u
    return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _logits_head(loss_and_backward):
    """A head from a (loss, G_Λ) rule on Λ = R U (M20 §8), sent back through the linear map (M20 §11)."""
    def head(r_BTD, u_DV):
        logits_BTV = _acc(r_BTD) @ _acc(u_DV)
        loss, g_logits_BTV = loss_and_backward(logits_BTV)
        return (loss, *linear_backward(_acc(r_BTD), _acc(u_DV), g_logits_BTV))
    return head


# ----- the objectives ---------------------------------------------------------------------------------------------
def analytic_value_and_grad(params, tokens_BT, targets_BT, mask_BT, cfg: ModelConfig, *, positions_BT=None,
                            segment_ids_BT=None, z_loss: float = 0.0, loss_chunk: int = 0):
    """The next-token loss of ``forward`` (M20 §10; with ``z_loss`` W, + (W/n) Σ_t b_t ℓ_t², the training step's
    loss per target) and its gradient by M20 §11's formulas, for any ``ModelConfig``. ``loss_chunk`` N > 0 forms
    the logits and their gradient N rows at a time (``chunked_lm_loss_and_backward``); the numbers are the same.
    Returns ``(loss, grads)`` with ``grads`` shaped like ``params``."""
    check_loss_mask(mask_BT)
    targets_BT, mask_BT = jnp.asarray(targets_BT), jnp.asarray(mask_BT)
    if loss_chunk:
        def head(r_BTD, u_DV):
            return chunked_lm_loss_and_backward(r_BTD, u_DV, targets_BT, mask_BT, chunk=loss_chunk, z_loss=z_loss)
    else:
        head = _logits_head(lambda logits: lm_loss_and_backward(logits, targets_BT, mask_BT, z_loss))
    return value_and_grad_with_head(params, tokens_BT, cfg, head, positions_BT=positions_BT,
                                    segment_ids_BT=segment_ids_BT)


def analytic_grad(params, tokens_BT, targets_BT, mask_BT, cfg: ModelConfig, **kwargs):
    """∇_θ of ``masked_cross_entropy(forward(params, tokens), targets, mask)`` by M20 §11, without autodiff
    (``analytic_value_and_grad``'s keywords: positions, segments, z-loss, loss chunk)."""
    return analytic_value_and_grad(params, tokens_BT, targets_BT, mask_BT, cfg, **kwargs)[1]


def diffusion_value_and_grad(params, z_BT, tokens_BT, masked_BT, t_B, maskable_BT, cfg: ModelConfig, *,
                             mask_id: int, positions_BT=None, segment_ids_BT=None):
    """``diffusion_loss`` for one drawn corruption (z_t, which positions are masked, t) and its gradient by hand:
    the bidirectional denoiser reads z_t, the NELBO head (``nelbo_loss_and_backward``) scores the clean tokens."""
    head = _logits_head(lambda logits: nelbo_loss_and_backward(logits, jnp.asarray(tokens_BT), masked_BT, t_B,
                                                               maskable_BT, mask_id))
    return value_and_grad_with_head(params, z_BT, cfg, head, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)


# ----- LoRA (U19 §10, M20 §16) -------------------------------------------------------------------------------------
def lora_backward(g_blocks, adapters, lora_cfg):
    """Adapter gradients from the gradients of the adapted weights: W = W₀ + s·A·B (s = α/r, W as its
    (d_in, d_out) matrix per layer) gives G_A = s·G_W Bᵀ and G_B = s·Aᵀ G_W; W₀ is frozen."""
    s = lora_cfg.scale
    groups_g = g_blocks if isinstance(g_blocks, list) else [g_blocks]
    groups_a = adapters["blocks"] if isinstance(adapters["blocks"], list) else [adapters["blocks"]]
    out = []
    for grads, entry in zip(groups_g, groups_a):
        new = {}
        for target, f in entry.items():
            a_LIR, b_LRO = _acc(f["A"]), _acc(f["B"])
            g_w_LIO = _acc(grads[target]).reshape(a_LIR.shape[0], a_LIR.shape[1], b_LRO.shape[2])
            new[target] = {"A": (s * g_w_LIO @ jnp.swapaxes(b_LRO, 1, 2)).astype(f["A"].dtype),
                           "B": (s * jnp.swapaxes(a_LIR, 1, 2) @ g_w_LIO).astype(f["B"].dtype)}
        out.append(new)
    return {"blocks": out if isinstance(adapters["blocks"], list) else out[0]}


def analytic_lora_value_and_grad(adapters, base, tokens_BT, targets_BT, mask_BT, cfg: ModelConfig, lora_cfg,
                                 **kwargs):
    """The next-token loss of the adapted model (``lora.adapted``: base frozen) and the adapters' gradient by hand
    (``analytic_value_and_grad``'s keywords). Returns ``(loss, grads)`` shaped like ``adapters``."""
    params = lora_lib.adapted(base, adapters, lora_cfg)
    loss, grads = analytic_value_and_grad(params, tokens_BT, targets_BT, mask_BT, cfg, **kwargs)
    return loss, lora_backward(grads["blocks"], adapters, lora_cfg)
