"""The chunked selective scan of the Mamba-1 recurrence (M20 §19; Gu & Dao 2023, §3.3), and ``"auto"``.

  s_{p,i,n} = Ā_{p,i,n} s_{p−1,i,n} + B̄x_{p,i,n},  Ā = exp(Δ A) (zero-order hold), B̄x = Δ B x (Euler),
  y_{p,i} = Σ_n C_{p,n} s_{p,i,n}.

``chunked_scan`` splits the T positions into G = ⌈T/K⌉ chunks of K positions. A ``lax.scan`` over the chunks
carries the state s (B, I, N); inside a chunk the K positions run in parallel: the chunk's Ā and B̄x are
materialised (B, K, N, I) and ``jax.lax.associative_scan`` combines them from the carried state (O(log K)
depth). The chunk body is wrapped in ``jax.checkpoint``, so the backward pass recomputes a chunk's interior
from its first state, as the paper's fused kernel recomputes the states (§3.3.2): the live memory is
O(B·K·I·N) for one chunk plus the G boundary states (G, B, I, N), never O(B·T·I·N). (The constant is that of
autodiff through ``associative_scan``: about 14 (B, K, I, N) float tensors at K = 64, so a smaller K trades
sequential depth for memory.) The sequential depth is G + O(log K) instead of ``fused_scan``'s T, the
accelerator-friendly shape; on XLA:CPU the one-position loop of ``fused_scan`` is the faster one, which is what
``resolve_ssm_scan`` picks for ``"auto"``.

Shape letters: B batch, T positions, G chunks, K positions of a chunk, I inner width, N state size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AUTO_SCAN = {"cpu": "fused", "gpu": "chunked", "tpu": "chunked"}  # what "auto" becomes on each platform


def resolve_ssm_scan(scan: str, platform: str) -> str:
    """The scan that ``"auto"`` stands for on ``platform`` ("cpu" → "fused", "gpu"/"tpu" → "chunked"); any
    other ``scan`` is returned unchanged (``mamba.mix`` checks it)."""
    if scan != "auto":
        return scan
    return AUTO_SCAN.get(platform, "fused")  # an unknown platform gets the scan with no parallel assumptions


def _compose(left, right):
    """(a1, b1)∘(a2, b2) = (a1·a2, a2·b1 + b2): the affine maps s ↦ a·s + b, applied 1 then 2 (associative)."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def _chunk(s_BNI, inputs, a_NI):
    """One chunk of K positions from the state s_BNI before it: returns (state after it, y_BKI).

    Ā_p = 0 where ``keep`` is 0 (a document start). The carried state enters as the first position's offset,
    b_0 ← b_0 + Ā_0 s, so the scanned b at position k is already the state s_k. The layout puts N before I
    (as ``fused_scan`` does) so that the wide channel axis I is the minor one.
    """
    dt_BKI, x_BKI, b_BKN, c_BKN, keep_BK = inputs
    dA_BKNI = jnp.exp(dt_BKI[:, :, None, :] * a_NI) * keep_BK[:, :, None, None]
    dBx_BKNI = b_BKN[:, :, :, None] * (dt_BKI * x_BKI)[:, :, None, :]
    dBx_BKNI = dBx_BKNI.at[:, 0].add(dA_BKNI[:, 0] * s_BNI)
    _, s_BKNI = jax.lax.associative_scan(_compose, (dA_BKNI, dBx_BKNI), axis=1)
    y_BKI = jnp.einsum("bkni,bkn->bki", s_BKNI, c_BKN)
    return s_BKNI[:, -1], y_BKI


def _to_chunks(v_BT, k: int):
    """(B, T, …) with T = G·K → (G, B, K, …), the chunk axis leading for ``lax.scan``."""
    bsz, t = v_BT.shape[:2]
    return jnp.moveaxis(v_BT.reshape((bsz, t // k, k) + v_BT.shape[2:]), 1, 0)


def _pad_positions(v_BT, pad: int):
    """Zeros after the last position: with Δ = 0 there Ā = 1 and B̄x = 0, the identity map on the state."""
    return jnp.pad(v_BT, ((0, 0), (0, pad)) + ((0, 0),) * (v_BT.ndim - 2))


def chunked_scan(dt_BTI, x_BTI, b_BTN, c_BTN, a_IN, reset_BT=None, s0_BIN=None, *, chunk: int = 64):
    """y_{p,i} = Σ_n C_{p,n} s_{p,i,n} and the last state s_{T−1}, exactly as ``mamba.fused_scan``, run as a
    ``lax.scan`` over chunks of ``chunk`` positions with a parallel scan inside each (module docstring).

    ``reset_BT`` (True at a document start) sets Ā = 0 there; ``s0_BIN`` is the state before position 0
    (zeros if None). Positions with Δ = 0 are the identity map, so T that is not a multiple of ``chunk`` is
    padded with them and the output sliced back. Computed in the inputs' dtype, at least float32.
    Returns (y (B, T, I), s_{T−1} (B, I, N)).
    """
    if chunk < 1:
        raise ValueError(f"chunk = {chunk} is invalid: it must be a positive integer")
    dtype = jnp.promote_types(dt_BTI.dtype, jnp.float32)
    dt_BTI, x_BTI, b_BTN, c_BTN, a_IN = (v.astype(dtype) for v in (dt_BTI, x_BTI, b_BTN, c_BTN, a_IN))
    bsz, t, inner = dt_BTI.shape
    keep_BT = (jnp.ones((bsz, t), dtype) if reset_BT is None
               else jnp.where(reset_BT, 0.0, 1.0).astype(dtype))
    s0_BNI = (jnp.zeros((bsz, a_IN.shape[1], inner), dtype) if s0_BIN is None
              else jnp.swapaxes(s0_BIN, 1, 2).astype(dtype))
    k = min(chunk, t)  # a chunk longer than T would only add identity positions
    pad = -t % k
    inputs = [_pad_positions(v, pad) for v in (dt_BTI, x_BTI, b_BTN, c_BTN)]
    inputs.append(jnp.pad(keep_BT, ((0, 0), (0, pad)), constant_values=1.0))
    # Recompute a chunk's interior in the backward pass instead of storing it: only the carries stay live.
    body = jax.checkpoint(lambda s_BNI, xs: _chunk(s_BNI, xs, a_IN.T), prevent_cse=False)
    s_last_BNI, y_GBKI = jax.lax.scan(body, s0_BNI, tuple(_to_chunks(v, k) for v in inputs))
    y_BTI = jnp.moveaxis(y_GBKI, 0, 1).reshape(bsz, t + pad, inner)[:, :t]
    return y_BTI, jnp.swapaxes(s_last_BNI, 1, 2)
