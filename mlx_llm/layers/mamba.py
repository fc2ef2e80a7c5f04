"""The Mamba-1 selective-SSM mixer (M20 §19; Gu & Dao 2023): full sequence (training, prefill) and decode.

Keys (DESIGN §1; I inner width, N state size, W conv width, R Δ rank, d model width): ``ssm_norm (d)``,
``in_x, in_z (d, I)``, ``conv_w (W, I)``, ``conv_b (I)``, ``w_dt (I, R)``, ``w_B, w_C (I, N)``,
``dt_proj (R, I)``, ``dt_bias (I)``, ``A_log (I, N)``, ``D (I)``, ``out_proj (I, d)``.

The branch is H' = H + M(N_γ(H)) (the residual carries H, as for attention, M20 §7). With Y = N_γ(H):
  X = Y W_x, Z = Y W_z;  X ← SiLU(causal depthwise conv_W(X) + b_conv);
  Δ = softplus((X W_dt) W_Δ + b_Δ) (B,T,I);  B = X W_B, C = X W_C (B,T,N);  A = −exp(A_log) (I,N);
  s_{p,i,n} = exp(Δ_{p,i} A_{i,n}) s_{p−1,i,n} + Δ_{p,i} B_{p,n} X_{p,i}   (zero-order hold for A, Euler for B)
  o_{p,i} = Σ_n C_{p,n} s_{p,i,n} + D_i X_{p,i};   M(Y) = (o ⊙ SiLU(Z)) W_out.
Per (i, n) this is M20 §19's scalar core s_p = Ā_p s_{p−1} + B̄_p u_p, y_p = C_p s_p + D u_p with input-dependent
("selective") Ā_p, B̄_p, C_p; ``recurrence`` is that scalar case.

The conv is causal: ``conv_w[k]`` multiplies the input at position t − (W−1) + k (row W−1 is the current
token, the cross-correlation order of the published code). Packed documents (``segment_ids_BT``) reset both
the conv window and the SSM state at each document start, so a packed row equals each document run alone.

Memory: the training path (``branch``) runs the recurrence as ``ModelConfig.ssm_scan`` says. "fused" (the
default, ``fused_scan``): one ``lax.scan`` over positions that discretises, advances and reads out in its body, so
Ā and B̄x are never materialised over T; its hand-written backward pass needs the states s_{p−1}, stored as one
(T, B, N, I) tensor. "associative": ``jax.lax.associative_scan`` over the materialised (B, T, I, N) Ā, B̄x and
states (O(log T) depth; several such tensors live in the backward pass). "chunked" (``kernels.ssm_scan``): a
``lax.scan`` over chunks of 64 positions with an associative scan inside each, whose backward pass recomputes a
chunk's states as the paper's fused CUDA kernel does: ~14 (B, 64, I, N) tensors plus the chunk-boundary states,
flat in T. "auto" is "chunked" on GPU/TPU and "fused" on CPU (``resolve_ssm_scan``). Decoding carries (conv window
(B, W−1, I), SSM state (B, I, N)) per layer, constant in the prefix length. The SSM coefficients, scan and state
run in at least float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from mlx_llm.kernels import SSM_SCANS as SCANS  # ModelConfig.ssm_scan's choices, checked by ``mix``
from mlx_llm.kernels import backend_platform
from mlx_llm.kernels.ssm_scan import chunked_scan, resolve_ssm_scan
from mlx_llm.layers import initializers, layout
from mlx_llm.layers.norm import norm
from mlx_llm.layers.state_spec import SlotSpec
from mlx_llm.ops import dense

DT_MIN, DT_MAX = 1e-3, 1e-1  # Δ at initialisation is log-uniform in [DT_MIN, DT_MAX] (Gu & Dao 2023, §3.6)
DRAWS = layout.draws(layout.MAMBA)  # normal() calls of ``init``: 9 (the projections, conv_w and the Δ draw)


def _accum_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def dims(cfg) -> tuple[int, int, int, int, int]:
    """(d, I, N, W, R) of a config-like object: I is ``cfg.ssm_inner`` if it has one, else ssm_expand·d."""
    return tuple(layout.dim(name, cfg) for name in ("D", "I", "N", "W", "R"))


# ----- initialisation ---------------------------------------------------------------------------------
def s4d_real_log_A(L: int, I: int, N: int, dtype) -> jax.Array:
    """A_log for S4D-real (Gu et al. 2022): A_{i,n} = −(n+1), so A_log_{i,n} = log(n+1) for every channel i."""
    return jnp.broadcast_to(jnp.log(jnp.arange(1, N + 1, dtype=_accum_dtype(dtype))), (L, I, N)).astype(dtype)


def dt_bias_from_normal(z, dtype) -> jax.Array:
    """Inverse softplus of Δ = exp(log Δ_min + u·(log Δ_max − log Δ_min)), u = Φ(z) ~ U(0, 1) for z ~ N(0, 1).

    The published init draws u uniformly; here u comes from one standard normal draw through its CDF Φ, so it
    stays on the shared key stream of ``normal``. softplus⁻¹(Δ) = Δ + log(−expm1(−Δ)) (stable for small Δ).
    """
    acc = _accum_dtype(dtype)
    u_ = jnp.clip(jax.scipy.stats.norm.cdf(z.astype(acc)), 0.0, 1.0)
    dt = jnp.exp(math.log(DT_MIN) + u_ * (math.log(DT_MAX) - math.log(DT_MIN)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _dt_bias_rule(shape, dtype, z):
    return dt_bias_from_normal(z, dtype)


def _a_log_rule(shape, dtype, z):
    return s4d_real_log_A(*shape, dtype)


INIT_RULES = {"dt_bias": _dt_bias_rule, "A_log": _a_log_rule}  # the inits ``layout.MAMBA`` names


def init(cfg, normal, L: int, dtype) -> dict:
    """Mamba keys for L stacked layers (``layout.MAMBA``), as published: A from S4D-real, D = 1, Δ log-uniform
    in [1e-3, 1e-1] through ``dt_bias``, conv_b = 0, norm gain 1. Every projection N(0, 1/fan_in) (fan_in = d
    for in_x/in_z, W for the depthwise conv, I for w_dt/w_B/w_C and out_proj, R for dt_proj); out_proj also
    × 1/√(2·n_layers) because it writes into the residual stream. Exactly ``DRAWS`` calls of ``normal``."""
    return initializers.init_table(layout.MAMBA, cfg, normal, L, dtype, INIT_RULES)


# ----- the scans ----------------------------------------------------------------------------------------
def _gate_resets(dA_BTIN, reset_BT):
    """Ā_p = 0 where a document starts, so nothing of the previous document is carried into s_p."""
    if reset_BT is None:
        return dA_BTIN
    return jnp.where(reset_BT[:, :, None, None], jnp.zeros((), dA_BTIN.dtype), dA_BTIN)


def scan_step(s_BIN, dA_BIN, dBx_BIN) -> jax.Array:
    """One position of M20 §19's recurrence: s_p = Ā_p ⊙ s_{p−1} + B̄_p x_p (elementwise over (i, n))."""
    return dA_BIN * s_BIN + dBx_BIN


def _with_initial_state(dA_BTIN, dBx_BTIN, s0_BIN):
    if s0_BIN is None:
        return dBx_BTIN
    return dBx_BTIN.at[:, 0].add(dA_BTIN[:, 0] * s0_BIN.astype(dBx_BTIN.dtype))


def selective_scan(dA_BTIN, dBx_BTIN, reset_BT=None, s0_BIN=None) -> jax.Array:
    """All states s (B, T, I, N) of s_p = Ā_p s_{p−1} + B̄_p x_p by ``jax.lax.associative_scan`` over positions.

    The pairs (a, b) standing for s ↦ a·s + b compose as (a1, b1)∘(a2, b2) = (a1·a2, a2·b1 + b2) (apply 1, then
    2); this is associative, so the T maps combine in O(log T) depth. ``reset_BT`` (True at a document start)
    sets a = 0 there; ``s0_BIN`` is the state before position 0 (zeros if None).
    """
    a_BTIN = _gate_resets(dA_BTIN, reset_BT)
    b_BTIN = _with_initial_state(a_BTIN, dBx_BTIN, s0_BIN)

    def compose(left, right):
        a1, b1 = left
        a2, b2 = right
        return a1 * a2, a2 * b1 + b2

    return jax.lax.associative_scan(compose, (a_BTIN, b_BTIN), axis=1)[1]


def sequential_scan(dA_BTIN, dBx_BTIN, reset_BT=None, s0_BIN=None) -> jax.Array:
    """The same states as ``selective_scan``, one position at a time with ``jax.lax.scan`` (``scan_step``, the
    rule decode uses): the reference the parallel scan is tested against."""
    a_BTIN = _gate_resets(dA_BTIN, reset_BT)
    if s0_BIN is None:
        s0_BIN = jnp.zeros(a_BTIN.shape[:1] + a_BTIN.shape[2:], dBx_BTIN.dtype)

    def body(s_BIN, ab):
        s_BIN = scan_step(s_BIN, *ab)
        return s_BIN, s_BIN

    _, s_TBIN = jax.lax.scan(body, s0_BIN.astype(dBx_BTIN.dtype),
                             (jnp.moveaxis(a_BTIN, 1, 0), jnp.moveaxis(dBx_BTIN, 1, 0)))
    return jnp.moveaxis(s_TBIN, 0, 1)


def recurrence(a_T, b_T, c_T, x_T, d):
    """M20 §19's scalar case: s_p = a_p s_{p−1} + b_p x_p, y_p = c_p s_p + d x_p, s_{−1} = 0. Returns (s_T, y_T).

    (Ā = 0.5, B̄ = C = 1, D = 0, inputs (1, 0, −1) give states and outputs (1, 0.5, −0.75).)
    """
    a_T, b_T, c_T, x_T = (jnp.broadcast_to(jnp.asarray(v), jnp.shape(x_T)) for v in (a_T, b_T, c_T, x_T))
    s_T = sequential_scan(a_T[None, :, None, None], (b_T * x_T)[None, :, None, None])[0, :, 0, 0]
    return s_T, c_T * s_T + d * x_T


# ----- the mixer, piece by piece ------------------------------------------------------------------------
def document_starts(segment_ids_BT) -> jax.Array:
    """True where position t begins a document (t = 0, or its segment id differs from position t − 1's)."""
    first_B1 = jnp.ones(segment_ids_BT.shape[:1] + (1,), bool)
    return jnp.concatenate([first_B1, segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)


def causal_conv(x_BTI, conv_w_WI, conv_b_I, segment_ids_BT=None) -> jax.Array:
    """Causal depthwise conv: u_{t,i} = b_i + Σ_k w_{k,i} x_{t−(W−1)+k, i}, over positions of t's document only
    (earlier positions and other documents contribute zero). Summed in at least float32."""
    acc = _accum_dtype(x_BTI.dtype)
    t, w = x_BTI.shape[1], conv_w_WI.shape[0]
    u_BTI = jnp.broadcast_to(conv_b_I.astype(acc), x_BTI.shape)
    for k in range(w):
        j = w - 1 - k  # how many positions back conv_w[k] reads
        x_shift = jnp.pad(x_BTI.astype(acc), ((0, 0), (j, 0), (0, 0)))[:, :t]
        if segment_ids_BT is not None and j:
            same_BT = jnp.pad(segment_ids_BT[:, :-j] == segment_ids_BT[:, j:], ((0, 0), (j, 0)))
            x_shift = jnp.where(same_BT[:, :, None], x_shift, 0.0)
        u_BTI = u_BTI + conv_w_WI[k].astype(acc) * x_shift
    return u_BTI.astype(x_BTI.dtype)


def in_projections(h_BTD, layer, cfg):
    """Y = N_γ(H) (M20 §4), then X = Y W_x and the gate Z = Y W_z, each (B, T, I)."""
    y_BTD = norm(h_BTD, layer["ssm_norm"], cfg)
    return dense(y_BTD, layer["in_x"]), dense(y_BTD, layer["in_z"])


def selective_inputs(x_BTI, layer):
    """The input-dependent ("selective") parameters, in at least float32: Δ = softplus((X W_dt) W_Δ + b_Δ)
    (B,T,I), B = X W_B and C = X W_C (B,T,N), and A = −exp(A_log) (I,N). Returns (X, Δ, B, C, A), X cast too."""
    x_BTI = x_BTI.astype(_accum_dtype(x_BTI.dtype))
    dt_BTI = jax.nn.softplus(dense(dense(x_BTI, layer["w_dt"]), layer["dt_proj"]) + layer["dt_bias"])
    b_BTN, c_BTN = dense(x_BTI, layer["w_B"]), dense(x_BTI, layer["w_C"])
    return x_BTI, dt_BTI, b_BTN, c_BTN, -jnp.exp(layer["A_log"].astype(x_BTI.dtype))


def discretise(dt_BTI, x_BTI, b_BTN, a_IN):
    """Ā = exp(Δ A) (zero-order hold) and B̄x = Δ B x (Euler), each (B, T, I, N)."""
    return jnp.exp(dt_BTI[..., None] * a_IN), (dt_BTI * x_BTI)[..., None] * b_BTN[:, :, None, :]


def ssm_coefficients(x_BTI, layer):
    """(Ā (B,T,I,N), B̄x (B,T,I,N), C (B,T,N)) of ``selective_inputs`` and ``discretise``."""
    x_BTI, dt_BTI, b_BTN, c_BTN, a_IN = selective_inputs(x_BTI, layer)
    return (*discretise(dt_BTI, x_BTI, b_BTN, a_IN), c_BTN)


# ----- the fused scan: one pass over positions, no (B, T, I, N) coefficient tensors --------------------------
def fused_scan(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, reset_BT=None, s0_BIN=None):
    """y_{p,i} = Σ_n C_{p,n} s_{p,i,n} for the recurrence of ``selective_scan``, and the last state s_{T−1}.

    One ``jax.lax.scan`` over positions whose body discretises position p, advances the state and reads it
    out, so only the (B, I, N) state is live: Ā and B̄x are never materialised over T. Its backward pass is
    written by hand (``_fused_scan_bwd``): a reverse scan of λ_p = ∂L/∂s_p = g_p ⊗ C_p + Ā_{p+1} ⊙ λ_{p+1}, with
    the per-position gradients of Δ, x, B, C read off λ_p and the stored s_{p−1}, and ∂L/∂A summed in the carry.
    The state is laid out (B, N, I) inside, so the sums over n are vector adds over channels. Memory: the
    forward stores s_{p−1} for every p (one (T, B, N, I) tensor) for the backward pass. On XLA:CPU this is
    ≈ 4× faster than the associative scan for training (experiments/bench_mamba.py); on accelerators the
    associative scan's O(log T) depth may win (``ModelConfig.ssm_scan``). Positions with Δ = 0 are the
    identity map, which ``advance`` uses for padding. Returns (y (B, T, I), s_{T−1} (B, I, N)).
    """
    bsz, _, inner = dt_BTI.shape
    keep_BT = jnp.ones(dt_BTI.shape[:2], dt_BTI.dtype)
    if reset_BT is not None:
        keep_BT = jnp.where(reset_BT, 0.0, 1.0).astype(dt_BTI.dtype)
    s0_BNI = (jnp.zeros((bsz, a_IN.shape[1], inner), dt_BTI.dtype) if s0_BIN is None
              else jnp.swapaxes(s0_BIN, 1, 2).astype(dt_BTI.dtype))
    y_BTI, s_last_BNI = _fused_scan(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s0_BNI)
    return y_BTI, jnp.swapaxes(s_last_BNI, 1, 2)


def _time_major(*arrays):
    return tuple(jnp.moveaxis(v, 1, 0) for v in arrays)


def _decay(dt_BI, a_NI, keep_B):
    """Ā_p laid out (B, N, I): exp(Δ_p A), zero where a document starts."""
    return jnp.exp(dt_BI[:, None, :] * a_NI) * keep_B[:, None, None]


@jax.custom_vjp
def _fused_scan(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s0_BNI):
    return _fused_scan_fwd(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s0_BNI)[0]


def _fused_scan_fwd(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s0_BNI):
    a_NI = a_IN.T

    def body(s_BNI, inputs):
        dt_BI, x_BI, b_BN, c_BN, keep_B = inputs
        s_new = _decay(dt_BI, a_NI, keep_B) * s_BNI + b_BN[:, :, None] * (dt_BI * x_BI)[:, None, :]
        return s_new, ((s_new * c_BN[:, :, None]).sum(1), s_BNI)

    s_last, (y_TBI, s_prev_TBNI) = jax.lax.scan(body, s0_BNI,
                                                _time_major(dt_BTI, x_BTI, b_BTN, c_BTN, keep_BT))
    residuals = (dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s_prev_TBNI)
    return (jnp.moveaxis(y_TBI, 0, 1), s_last), residuals


def _fused_scan_bwd(residuals, cotangents):
    """λ_p = g_p ⊗ C_p + Ā_{p+1} ⊙ λ_{p+1} (λ_{T−1} also gets the cotangent of s_{T−1}); with u_p = Δ_p x_p:
    ∂C_p = Σ_i g_p s_p, ∂u_p = Σ_n λ_p B_p, ∂B_p = Σ_i λ_p u_p, ∂Ā_p = λ_p s_{p−1} so ∂Δ_p = Σ_n A λ_p s_{p−1}
    Ā_p + x_p ∂u_p, ∂x_p = Δ_p ∂u_p, ∂A = Σ_{b,p} Δ_p λ_p s_{p−1} Ā_p, ∂s_{−1} = Ā_0 λ_0."""
    dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, keep_BT, s_prev_TBNI = residuals
    g_BTI, g_last_BNI = cotangents
    a_NI = a_IN.T

    def body(carry, inputs):
        lam_next, decay_next, da_NI = carry
        dt_BI, x_BI, b_BN, c_BN, keep_B, g_BI, s_prev = inputs
        decay = _decay(dt_BI, a_NI, keep_B)
        u_BI = dt_BI * x_BI
        lam = c_BN[:, :, None] * g_BI[:, None, :] + decay_next * lam_next
        s_BNI = decay * s_prev + b_BN[:, :, None] * u_BI[:, None, :]
        du_BI = (lam * b_BN[:, :, None]).sum(1)
        q_BNI = lam * s_prev * decay
        grads = ((q_BNI * a_NI).sum(1) + du_BI * x_BI, du_BI * dt_BI, (lam * u_BI[:, None, :]).sum(2),
                 (s_BNI * g_BI[:, None, :]).sum(2))
        return (lam, decay, da_NI + (q_BNI * dt_BI[:, None, :]).sum(0)), grads

    init = (g_last_BNI, jnp.ones_like(g_last_BNI), jnp.zeros_like(a_NI))
    (lam0, decay0, da_NI), grads = jax.lax.scan(
        body, init, _time_major(dt_BTI, x_BTI, b_BTN, c_BTN, keep_BT, g_BTI) + (s_prev_TBNI,), reverse=True)
    d_dt, d_x, d_b, d_c = (jnp.moveaxis(v, 0, 1) for v in grads)
    return d_dt, d_x, d_b, d_c, da_NI.T, jnp.zeros_like(keep_BT), decay0 * lam0


_fused_scan.defvjp(_fused_scan_fwd, _fused_scan_bwd)


def ssm_output(s_BTIN, c_BTN, x_BTI, layer) -> jax.Array:
    """o_{p,i} = Σ_n C_{p,n} s_{p,i,n} + D_i x_{p,i} (the y_p = C_p s_p + D u_p of M20 §19)."""
    x_BTI = x_BTI.astype(s_BTIN.dtype)
    return jnp.einsum("btin,btn->bti", s_BTIN, c_BTN) + layer["D"].astype(x_BTI.dtype) * x_BTI


def out_projection(o_BTI, z_BTI, layer) -> jax.Array:
    """M(Y) = (o ⊙ SiLU(Z)) W_out, in the compute dtype of Z."""
    return dense(o_BTI.astype(z_BTI.dtype) * jax.nn.silu(z_BTI), layer["out_proj"])


def mix(x_BTI, layer, scan="fused", reset_BT=None, s0_BIN=None, real_BT=None):
    """The SSM part of the mixer over a sequence: o = Σ_n C s + D ⊙ X for the conv output X (B, T, I), from the
    state ``s0_BIN`` (zeros if None). ``scan`` is "fused" (``fused_scan``), "chunked" (``chunked_scan``), "auto"
    (one of those two for the default backend) or "associative" (``discretise`` then ``selective_scan``:
    O(log T) depth, (B, T, I, N) tensors). Where ``real_BT`` is False, Δ is set to 0: the state passes through
    unchanged (Ā = 1, B̄x = 0), so the returned last state is that of the last real position.
    Returns (o (B, T, I), last state (B, I, N))."""
    if scan not in SCANS:
        raise ValueError(f"scan = {scan!r} is invalid: valid scans are {list(SCANS)}")
    scan = resolve_ssm_scan(scan, backend_platform())
    x_BTI, dt_BTI, b_BTN, c_BTN, a_IN = selective_inputs(x_BTI, layer)
    if real_BT is not None:
        dt_BTI = jnp.where(real_BT[:, :, None], dt_BTI, 0.0)
    if scan in ("fused", "chunked"):
        scan_fn = fused_scan if scan == "fused" else chunked_scan
        y_BTI, s_last = scan_fn(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, reset_BT, s0_BIN)
    else:
        s_BTIN = selective_scan(*discretise(dt_BTI, x_BTI, b_BTN, a_IN), reset_BT, s0_BIN)
        y_BTI, s_last = jnp.einsum("btin,btn->bti", s_BTIN, c_BTN), s_BTIN[:, -1]
    return y_BTI + layer["D"].astype(x_BTI.dtype) * x_BTI, s_last


def branch(h_BTD, layer, cfg, ctx) -> jax.Array:
    """H + M(N_γ(H)) over the whole sequence (module docstring). ``ctx.segment_ids_BT`` (or ``ctx`` itself) may
    be None: one document per row; else (B, T) ids and both the conv window and the state reset per document.
    The recurrence runs as ``cfg.ssm_scan`` says (``mix``; "fused" when the config has no such field)."""
    segment_ids_BT = getattr(ctx, "segment_ids_BT", None)
    reset_BT = None if segment_ids_BT is None else document_starts(segment_ids_BT)
    x_BTI, z_BTI = in_projections(h_BTD, layer, cfg)
    x_BTI = jax.nn.silu(causal_conv(x_BTI, layer["conv_w"], layer["conv_b"], segment_ids_BT))
    o_BTI, _ = mix(x_BTI, layer, getattr(cfg, "ssm_scan", "fused"), reset_BT)
    return h_BTD + out_projection(o_BTI, z_BTI, layer).astype(h_BTD.dtype)


# ----- decoding -------------------------------------------------------------------------------------------
def init_state(cfg, batch: int, dtype=jnp.float32):
    """An empty decode state of one layer: (conv window (B, W−1, I) in ``dtype``: the last W−1 inputs of the
    conv, SSM state (B, I, N) in at least float32), zeros, i.e. the zero padding before the first token."""
    _, I, N, W, _ = dims(cfg)
    return jnp.zeros((batch, W - 1, I), dtype), jnp.zeros((batch, I, N), _accum_dtype(dtype))


def step(h_BD, layer, cfg, conv_BWI, ssm_BIN):
    """One token of ``branch`` from the carried state: the conv reads window + current input, the state takes
    one ``scan_step``. Returns (H' (B, D), conv window', SSM state')."""
    x_B1I, z_B1I = in_projections(h_BD[:, None], layer, cfg)
    window_BWI = jnp.concatenate([conv_BWI, x_B1I.astype(conv_BWI.dtype)], axis=1)
    acc = _accum_dtype(x_B1I.dtype)
    u_BI = layer["conv_b"].astype(acc) + jnp.einsum("bwi,wi->bi", window_BWI.astype(acc),
                                                    layer["conv_w"].astype(acc))
    x_B1I = jax.nn.silu(u_BI.astype(x_B1I.dtype))[:, None]
    dA_B1IN, dBx_B1IN, c_B1N = ssm_coefficients(x_B1I, layer)
    s_BIN = scan_step(ssm_BIN.astype(dA_B1IN.dtype), dA_B1IN[:, 0], dBx_B1IN[:, 0])
    out_B1D = out_projection(ssm_output(s_BIN[:, None], c_B1N, x_B1I, layer), z_B1I, layer)
    return h_BD + out_B1D[:, 0].astype(h_BD.dtype), window_BWI[:, 1:], s_BIN.astype(ssm_BIN.dtype)


def advance(h_BTD, layer, cfg, conv_BWI, ssm_BIN, n_new_B):
    """T new positions of each row, of which only the first ``n_new_B[b]`` are real (prefill or decode),
    continuing from the carried (conv window, SSM state). One token goes through ``step``; several go through
    the parallel path of ``branch``: the window is prepended to the conv's input, the scan starts from the
    carried state, and each row's new window and state are read off at its last real token (padding comes
    after the real tokens, so it never reaches them). Returns (H' (B, T, D), conv window', SSM state')."""
    if h_BTD.shape[1] == 1:
        out_BD, conv_new, ssm_new = step(h_BTD[:, 0], layer, cfg, conv_BWI, ssm_BIN)
        real_B = n_new_B > 0
        return (out_BD[:, None], jnp.where(real_B[:, None, None], conv_new, conv_BWI),
                jnp.where(real_B[:, None, None], ssm_new, ssm_BIN))
    w1 = conv_BWI.shape[1]
    x_BTI, z_BTI = in_projections(h_BTD, layer, cfg)
    x_full = jnp.concatenate([conv_BWI, x_BTI.astype(conv_BWI.dtype)], axis=1)  # (B, W−1+T, I)
    x_conv = jax.nn.silu(causal_conv(x_full.astype(x_BTI.dtype), layer["conv_w"], layer["conv_b"])[:, w1:])
    n_B = n_new_B.astype(jnp.int32)
    real_BT = jnp.arange(h_BTD.shape[1])[None, :] < n_B[:, None]
    o_BTI, s_last = mix(x_conv, layer, getattr(cfg, "ssm_scan", "fused"), None, ssm_BIN, real_BT)
    out_BTD = h_BTD + out_projection(o_BTI, z_BTI, layer).astype(h_BTD.dtype)
    ssm_new = s_last.astype(ssm_BIN.dtype)
    window_idx = n_B[:, None] + jnp.arange(w1)[None, :]  # x_full index j holds the input of position j − (W−1)
    conv_new = jnp.take_along_axis(x_full, window_idx[:, :, None], axis=1)
    return out_BTD, conv_new, ssm_new


def state_spec(cfg, kind: str) -> SlotSpec:
    """What a cached call carries for a Mamba layer: ``init_state``'s conv window and SSM state per sequence."""
    return SlotSpec(init=functools.partial(init_state, cfg))


def decode_branch(h_BTD, layer, cfg, ctx, view, kind: str):
    """``advance`` from the state the decode ``view`` holds for this layer; the new state goes back through it.
    Returns (H', the updated view)."""
    conv_BWI, ssm_BIN = view.read()
    h_BTD, conv_BWI, ssm_BIN = advance(h_BTD, layer, cfg, conv_BWI, ssm_BIN, view.n_new_B)
    return h_BTD, view.write(conv_BWI, ssm_BIN)
