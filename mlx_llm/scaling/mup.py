"""μP in practice: a width ladder of one model, the coordinate check, and the fold of μP's multipliers into
standard weights.

The rules themselves are declared with the layout (``layers/layout.py``: ``mup_class``, ``mup_init_mult``,
``output_mult``, ``attention_q_mult``, ``mup_lr_mult``); the training chain applies the learning-rate multipliers
(``train.optim.mup_lr_scales``). Here:

- ``with_width(cfg, d)``: the model at another width, every width dimension scaled by d / d_model (heads at a fixed
  head width, the FFN width in proportion);
- ``coord_check(cfg, widths)``: the coordinate check of Yang et al. 2022 (Tensor Programs V, §6 and their Figure 5):
  train each width a few steps with Adam at one learning rate on one batch and record the RMS of every layer's
  activations after each step. Under μP the curves lie on top of each other across widths; under SP they grow with
  width (the updates of a hidden layer add up over d correlated coordinates);
- ``to_standard(params, cfg)``: the standard-parametrization model that computes the same function (the output
  multiplier folded into the unembedding, the attention scale into W^Q, or into the Q norm's gain), which the HF
  export writes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mlx_llm import model as model_lib
from mlx_llm.config import MUP_FFNS, MUP_MIXERS, ModelConfig
from mlx_llm.errors import InputError
from mlx_llm.layers import attention, ffn, layout
from mlx_llm.ops import causal_mask, seed_key


def with_width(cfg: ModelConfig, d_model: int) -> ModelConfig:
    """``cfg`` at width ``d_model``: heads and key/value heads (at ``cfg``'s head width) and ``d_ff`` scaled by
    d_model / cfg.d_model; every other field (the μP base included) as it is. Each scaled size must come out a
    whole number."""
    ratio = d_model / cfg.d_model
    sizes = {"d_model": d_model}
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(cfg, name)
        if value is not None:
            scaled = value * ratio
            if scaled != int(scaled) or scaled < 1:
                raise InputError(f"width {d_model}: {name} = {value} × {d_model}/{cfg.d_model} = {scaled:g} is not a "
                                 f"whole number ≥ 1; choose widths that scale it exactly")
            sizes[name] = int(scaled)
    return dataclasses.replace(cfg, **sizes)


def _rms(x) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


def activation_rms(params, tokens_BT, cfg: ModelConfig) -> dict[str, jax.Array]:
    """RMS of the activations of one forward: ``embed`` (H⁰), for every layer ℓ the outputs of its branches
    ``layer{ℓ}.attn`` (A(N(H))) and ``layer{ℓ}.ffn`` (F(N(Z))) and the residual stream after it ``layer{ℓ}.out``,
    and the ``logits``. Attention (full or local) and SwiGLU layers."""
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    ctx = model_lib.Context(positions_BT, causal_mask(None, b, t))
    h_BTD = model_lib.embed(params, tokens_BT)
    out = {"embed": _rms(h_BTD)}
    for l, (layer, (mixer, ffn_kind)) in enumerate(model_lib.layer_list(params, cfg)):
        z_BTD = attention.branch(h_BTD, layer, cfg, ctx, window=cfg.window(mixer))
        out[f"layer{l}.attn"] = _rms(z_BTD - h_BTD)
        h_BTD = z_BTD if ffn_kind == "none" else ffn.branch(z_BTD, layer, cfg)[0]
        if ffn_kind != "none":
            out[f"layer{l}.ffn"] = _rms(h_BTD - z_BTD)
        out[f"layer{l}.out"] = _rms(h_BTD)
    out["logits"] = _rms(model_lib.logits_from_hidden(h_BTD, params, cfg))
    return out


@dataclasses.dataclass(frozen=True)
class CoordCheck:
    """``rms[name]``: (len(widths), steps + 1) activation RMS, row i at ``widths[i]``, column s after s Adam steps
    (column 0: at initialisation); ``losses``: (len(widths), steps + 1), the batch's loss before each step and
    after the last."""

    widths: tuple[int, ...]
    steps: int
    rms: dict[str, np.ndarray]
    losses: np.ndarray

    def spread(self, step: int | None = None) -> dict[str, float]:
        """Per activation: its RMS at the widest width over its RMS at the narrowest, after ``step`` steps
        (default the last): ≈ 1 when it does not move with width."""
        s = self.steps if step is None else step
        order = np.argsort(self.widths)
        return {k: float(v[order[-1], s] / v[order[0], s]) for k, v in self.rms.items()}

    def as_dict(self) -> dict:
        return {"widths": list(self.widths), "steps": self.steps, "losses": self.losses.tolist(),
                "rms": {k: v.tolist() for k, v in self.rms.items()}}


def _adam(cfg: ModelConfig, lr: float):
    """(Adam, its jitted step, the jitted loss) for ``cfg``: one Adam step (no clipping, no decay, constant η) with
    μP's per-leaf multipliers ``layout.mup_lr_mult`` (η/m on the hidden weights; none under SP) on the batch's
    next-token loss; the step returns (params', state', loss before the step)."""
    infos = layout.entries()
    adam = optax.adam(lr)

    def loss_fn(params, tokens_BT):
        logits_BTV = model_lib.forward(params, tokens_BT[:, :-1], cfg)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]))

    def step(params, opt_state, tokens_BT):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT)
        updates, opt_state = adam.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map_with_path(
            lambda path, u: u * layout.mup_lr_mult(infos[getattr(path[-1], "key", None)], cfg), updates)
        return optax.apply_updates(params, updates), opt_state, loss

    return adam, jax.jit(step), jax.jit(loss_fn)


def coord_check(cfg: ModelConfig, widths, *, steps: int = 3, lr: float = 1e-2, batch_size: int = 4,
                seq_len: int = 32, seed: int = 0) -> CoordCheck:
    """Yang et al.'s coordinate check of ``cfg``'s parametrization: for each width (``with_width``), parameters
    from ``seed``, then ``steps`` Adam steps at learning rate ``lr`` (μP's multipliers applied under μP) on one
    fixed batch of ``batch_size`` random token sequences of ``seq_len`` + 1 tokens (the same batch at every width);
    the activation RMS (``activation_rms``) of the batch is recorded before the first step and after each.
    Attention (full or local) and SwiGLU stacks."""
    bad = sorted((set(cfg.mixer_pattern) - set(MUP_MIXERS)) | (set(cfg.ffn_pattern) - set(MUP_FFNS)))
    if bad:
        raise InputError(f"coord_check runs attention and SwiGLU stacks; this config has layer kind(s) {bad}")
    widths = tuple(int(w) for w in widths)
    if len(widths) < 2 or len(set(widths)) != len(widths):
        raise InputError(f"coord_check needs at least two distinct widths; got {list(widths)}")
    if not (isinstance(steps, int) and steps >= 1):
        raise InputError(f"steps = {steps!r} is invalid: it must be an integer >= 1")
    tokens_BT = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch_size, seq_len + 1)),
                            jnp.int32)
    rms, losses = {}, []
    for i, width in enumerate(widths):
        c = with_width(cfg, width)
        params = model_lib.init_params(c, seed_key(seed))
        adam, step, loss_fn = _adam(c, lr)
        opt_state, measure = adam.init(params), jax.jit(lambda p, c=c: activation_rms(p, tokens_BT[:, :-1], c))
        rows, row_losses = [measure(params)], []
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, tokens_BT)
            rows.append(measure(params))
            row_losses.append(loss)
        row_losses.append(loss_fn(params, tokens_BT))
        for k in rows[0]:
            rms.setdefault(k, np.zeros((len(widths), steps + 1)))[i] = [float(r[k]) for r in rows]
        losses.append([float(x) for x in row_losses])
    return CoordCheck(widths, steps, rms, np.asarray(losses))


# ----- the standard model of a μP one --------------------------------------------------------------------------
def standard_config(cfg: ModelConfig) -> ModelConfig:
    """The standard-parametrization config of a μP one (``to_standard``'s): untied, since under μP a tied table is
    read unscaled as the embedding and scaled by 1/m as the output."""
    if cfg.parametrization == "sp":
        return cfg
    return dataclasses.replace(cfg, parametrization="sp", mup_base_width=None, mup_base_head_width=None,
                               tie_embeddings=False)


def to_standard(params, cfg: ModelConfig):
    """(params, config) of the standard-parametrization model that computes what ``params`` compute under the μP
    ``cfg``: the unembedding becomes α·U (α = ``layout.output_mult``; a tied table gets its own α·Eᵀ), and Q's
    factor c = ``layout.attention_q_mult`` goes into W^Q and b^Q, or, with ``qk_norm`` (which would normalise it
    away), into the Q norm's gain. An SP config is returned as it is."""
    if cfg.parametrization == "sp":
        return params, cfg
    out = dict(params)
    u = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    out["unembed"] = u * np.asarray(layout.output_mult(cfg), dtype=np.asarray(u).dtype)
    c = layout.attention_q_mult(cfg)
    groups = [params["blocks"]] if cfg.uniform else params["blocks"]
    scaled = []
    for group in groups:
        group = dict(group)
        names = ("q_norm",) if cfg.qk_norm else ("wq", "bq") if cfg.qkv_bias else ("wq",)
        for name in names:
            if name in group:
                group[name] = group[name] * np.asarray(c, dtype=np.asarray(group[name]).dtype)
        scaled.append(group)
    out["blocks"] = scaled[0] if cfg.uniform else scaled
    return out, standard_config(cfg)
