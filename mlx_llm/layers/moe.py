"""The mixture-of-experts FFN (M20 §15, U19 §3): router, balancing offsets, dropless sorted dispatch.

Keys (DESIGN §1; X routed experts, S shared, m = ``moe_d_ff``): ``ffn_norm (d)``, ``router (d, X)``,
``router_offset (X)`` (routing state, not θ), ``expert_gate, expert_up (X, d, m)``, ``expert_down (X, m, d)``,
``shared_gate, shared_up (S, d, m)``, ``shared_down (S, m, d)`` (absent when S = 0).

F_MoE(y) = Σ_{e∈S(y)} w_e(y) F_e(y) + Σ_{e∈shared} F_e(y), every F_e a SwiGLU (M20 §7). No capacity limit
and no token dropping (M20 §15 excludes them): each token reaches its k experts whatever the batch.

Dispatch is sort-based and dropless, in the style of MegaBlocks (Gale et al. 2023): the N·k (token, expert)
assignments are sorted by expert and each expert's run of rows is multiplied by its own matrices (a grouped
matrix product). ``branch`` takes the execution path as ``impl`` (DESIGN §6; "auto" is resolved by the caller,
``kernels.Kernels.resolve``), every path equal to ``dense_reference`` to float tolerance:

- "block" (``expert_ffn``, the reference and the CPU path): each expert's run is padded to a multiple of a block
  of ``block_size`` rows and every block is multiplied by its expert's matrices (at most N·k/BLOCK + X blocks),
  so the FLOPs are the active ones plus the padding (< BLOCK rows per expert). Plain gathers and einsums: fast
  on XLA:CPU, which lowers ``jax.lax.ragged_dot`` to a masked product with all X experts on every row.
- "ragged_dot" (the GPU path), "megablox" (the TPU path; ``kernels.gmm.grouped_expert_ffn``): the grouped
  product as ``jax.lax.ragged_dot`` or the TPU Pallas megablox kernel, with no padding blocks; under a mesh each
  token shard sorts its own assignments inside ``jax.shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import ConfigError, InputError
from mlx_llm.kernels import MOE_IMPLS as _ALL_MOE_IMPLS
from mlx_llm.kernels.gmm import grouped_expert_ffn, on_token_shards
from mlx_llm.layers import initializers, layout
from mlx_llm.layers.norm import norm, post_norm
from mlx_llm.ops import dense, swiglu

MOE_IMPLS = tuple(i for i in _ALL_MOE_IMPLS if i != "auto")  # what ``branch`` runs ("auto" is resolved before)
BLOCK = 256  # the largest block: bigger blocks run faster on XLA:CPU, smaller ones pad less (bench_moe.py)


def block_size(rows: int, n_experts: int) -> int:
    """Rows per block for ``rows`` assignments: the largest power of two ≤ rows/(2X), at most ``BLOCK``, so
    the expected padding (X·block/2 rows) stays ≤ a quarter of the work. 1 for decoding-sized batches, where
    there is no padding at all (each row is its own block)."""
    target = max(rows // (2 * n_experts), 1)
    return min(BLOCK, 1 << (target.bit_length() - 1))


def init(cfg, normal, L: int, dtype) -> dict:
    """MoE keys for L stacked layers (``layout.MOE``). Router N(0, 1/d); experts like the dense SwiGLU
    (N(0, 1/fan_in), the down projections × 1/√(2·n_layers)); offsets start at 0. The shared experts' three
    draws are taken even when S = 0 (empty arrays, left out), so the key stream does not depend on S."""
    return initializers.init_table(layout.MOE, cfg, normal, L, dtype)


# ----- the router (M20 §15, U19 §3) ------------------------------------------------------------------
def route(router_logits, offsets, top_k: int, *, router: str = "sigmoid", eps: float = 1e-9):
    """(expert_ids (..., k), weights (..., k)) of each row of ``router_logits`` (..., X).

    sigmoid (M20 §15): a = σ(r); S(y) = TopK(a + b); w_e = a_e / (ε_r + Σ_{j∈S} a_j), from the original scores.
    softmax (U19 §3): S(y) = TopK(r + b); w = softmax of the selected logits r_e (ε unused).
    The offsets b only choose the set (through ``stop_gradient``: they are routing state, not θ); ids are in
    order of decreasing selection score. Computed in at least float32.
    """
    if router not in ("sigmoid", "softmax"):
        raise ConfigError(f"route: router = {router!r} is invalid: valid routers are ['sigmoid', 'softmax']")
    x = router_logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= x:
        raise ConfigError(f"route: top_k = {top_k!r} is invalid: it must be an integer in [1, n_experts = {x}]")
    if jnp.shape(offsets) != (x,):
        raise InputError(f"route: offsets have shape {jnp.shape(offsets)}; expected ({x},), one per expert")
    r = router_logits.astype(jnp.promote_types(router_logits.dtype, jnp.float32))
    b = jax.lax.stop_gradient(jnp.asarray(offsets, r.dtype))
    scores = jax.nn.sigmoid(r) if router == "sigmoid" else r
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(scores) + b, top_k)
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    if router == "sigmoid":
        weights = chosen / (eps + jnp.sum(chosen, axis=-1, keepdims=True))
    else:
        weights = jax.nn.softmax(chosen, axis=-1)
    return ids, weights


def expert_load(expert_ids, n_experts: int) -> jax.Array:
    """Assignments per expert, (X,) float32: how many (token, slot) pairs chose each expert."""
    return jnp.zeros((n_experts,), jnp.float32).at[expert_ids.reshape(-1)].add(1.0)


def update_offsets(offsets, load, rate: float):
    """M20 §15's control rule, outside AdamW: b_e ← b_e + u·sign(mean load − load_e).

    ``load`` counts assignments over the whole global batch of one optimizer step; an overloaded expert's
    offset falls, an idle one's rises. Works on (X,) or stacked (L, X) offsets (mean over the last axis).
    """
    offsets = jnp.asarray(offsets)
    load = jnp.asarray(load, offsets.dtype)  # the step u·sign(·) in the offsets' own precision
    if jnp.shape(load) != jnp.shape(offsets):
        raise InputError(f"update_offsets: load has shape {jnp.shape(load)} but offsets have {jnp.shape(offsets)}")
    step = jnp.asarray(rate, offsets.dtype) * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return offsets + step


def apply_offset_rule(blocks, load, rate: float):
    """``update_offsets`` on every MoE layer of ``params["blocks"]`` (a dict, or a list for mixed stacks),
    with ``load`` the auxiliary output of the forward, stacked the same way."""
    if isinstance(blocks, list):
        return [apply_offset_rule(b, l, rate) for b, l in zip(blocks, load)]
    if "router_offset" not in load:
        return blocks
    return {**blocks, "router_offset": update_offsets(blocks["router_offset"], load["router_offset"], rate)}


def zero_load(blocks):
    """An all-zero expert load stacked like the offsets of ``blocks`` (the accumulator of a train step)."""
    if isinstance(blocks, list):
        return [zero_load(b) for b in blocks]
    if "router_offset" not in blocks:
        return {}
    return {"router_offset": jnp.zeros(blocks["router_offset"].shape, jnp.float32)}


def per_layer_loads(load, cfg) -> list[tuple[int, np.ndarray]]:
    """[(layer index, assignments per expert (X,))] for every MoE layer, in stack order (host side)."""
    groups = load if isinstance(load, list) else [load]
    out = []
    for l in range(cfg.n_layers):
        group = groups[l % cfg.period]
        if "router_offset" in group:
            out.append((l, np.asarray(group["router_offset"])[l // cfg.period]))
    return out


def load_imbalance(load) -> jax.Array:
    """max load / mean load per layer (1 = perfectly even; X/k = every token to the same k experts)."""
    load = jnp.asarray(load, jnp.float32)
    return jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-30)


# ----- dropless dispatch -----------------------------------------------------------------------------
def _block_layout(ids_NK, n_experts: int, block: int):
    """Where each assignment goes in the padded, expert-sorted row space, and each block's expert.

    Returns (order (N·k,): assignment index of each sorted row, dest (N·k,): padded row of sorted row i,
    block_expert (nb,), n_blocks). nb = ⌈N·k/block⌉ + X is a static bound on Σ_e ⌈load_e/block⌉ (with
    block = 1 the bound is exactly N·k: nothing is padded).
    """
    flat = ids_NK.reshape(-1)
    rows = flat.shape[0]
    n_blocks = -(-rows // block) + (n_experts if block > 1 else 0)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    padded = (counts + block - 1) // block * block
    end_pad = jnp.cumsum(padded)
    e_sorted = flat[order]
    rank = jnp.arange(rows, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[e_sorted]
    dest = (end_pad - padded)[e_sorted] + rank
    block_expert = jnp.searchsorted(end_pad, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right")
    return order, dest, jnp.minimum(block_expert, n_experts - 1), n_blocks


def grouped_matmul(x_nbD, w_XDF, block_expert):
    """Block i of rows (b, D) times its expert's matrix w[block_expert[i]] (D, F) → (nb, b, F)."""
    return jnp.einsum("nbd,ndf->nbf", x_nbD, w_XDF[block_expert])


def expert_ffn(y_ND, ids_NK, weights_NK, w_gate_XDF, w_up_XDF, w_down_XFD, *, block: int | None = None):
    """Σ_{e∈S(y)} w_e F_e(y) for every row of y (N, D), computing only the selected experts (dropless).

    ``block`` (rows per block) defaults to ``block_size(N·k, X)``.
    """
    n, d = y_ND.shape
    k = ids_NK.shape[-1]
    x = w_gate_XDF.shape[0]
    block = block_size(n * k, x) if block is None else block
    order, dest, block_expert, n_blocks = _block_layout(ids_NK, x, block)
    token = order // k
    rows = jnp.zeros((n_blocks * block, d), y_ND.dtype).at[dest].set(y_ND[token], unique_indices=True)
    rows = rows.reshape(n_blocks, block, d)
    c = (jax.nn.silu(grouped_matmul(rows, w_gate_XDF, block_expert))
         * grouped_matmul(rows, w_up_XDF, block_expert))
    out_sorted = grouped_matmul(c, w_down_XFD, block_expert).reshape(n_blocks * block, d)[dest]
    w_sorted = weights_NK.reshape(-1)[order].astype(out_sorted.dtype)
    out_NKD = jnp.zeros((n * k, d), out_sorted.dtype).at[order].set(out_sorted * w_sorted[:, None],
                                                                     unique_indices=True)
    return out_NKD.reshape(n, k, d).sum(axis=1)


def dense_reference(y_ND, ids_NK, weights_NK, w_gate_XDF, w_up_XDF, w_down_XFD):
    """Every expert on every row, then the selected ones mixed: the slow, obviously-correct reference the
    tests compare ``expert_ffn`` with. Never used for training."""
    all_XND = jax.vmap(lambda g, u, dn: swiglu(y_ND, g, u, dn))(w_gate_XDF, w_up_XDF, w_down_XFD)
    picked_NKD = all_XND[ids_NK, jnp.arange(y_ND.shape[0])[:, None]]
    return jnp.sum(weights_NK[..., None].astype(picked_NKD.dtype) * picked_NKD, axis=1)


def shared_experts(y_ND, gate_SDF, up_SDF, down_SFD):
    """Σ_s F_s(y) as one SwiGLU of width S·m: the S gates (and ups) side by side as columns, the S downs stacked
    as rows, so Σ_s [SiLU(y G_s) ⊙ y U_s] D_s is three matrix products instead of 3·S."""
    s, d, f = gate_SDF.shape
    side_by_side = lambda w: w.transpose(1, 0, 2).reshape(d, s * f)
    return swiglu(y_ND, side_by_side(gate_SDF), side_by_side(up_SDF), down_SFD.reshape(s * f, d))


def routed_experts(y_ND, ids_NK, weights_NK, layer, impl: str = "block", interpret: bool = False):
    """Σ_{e∈S(y)} w_e F_e(y) (M20 §15) by the execution path ``impl`` (one of ``MOE_IMPLS``); ``interpret`` runs
    the megablox kernel in Pallas interpret mode (tests)."""
    experts = (layer["expert_gate"], layer["expert_up"], layer["expert_down"])
    if impl == "block":  # per token shard under a mesh, like the grouped paths (kernels/gmm.on_token_shards)
        return on_token_shards(expert_ffn, y_ND.shape[0])(y_ND, ids_NK, weights_NK, *experts)
    return grouped_expert_ffn(y_ND, ids_NK, weights_NK, *experts, impl=impl, interpret=interpret)


def branch(z_BTD, layer, cfg, impl: str = "block", interpret: bool = False):
    """H = Z + F_MoE(N_γf(Z)) (M20 §15 substituted into §7). Returns (H, {"router_offset": load (X,)}): the
    load sits under the offsets' key so the train step can apply the control rule leaf by leaf. ``impl`` picks
    the routed experts' execution path (``MOE_IMPLS``); routing, loads and shared experts do not depend on it."""
    if impl not in MOE_IMPLS:
        raise ConfigError(f"moe.branch: impl = {impl!r} is invalid: valid impls are {list(MOE_IMPLS)} "
                          f"(resolve 'auto' with Kernels.resolve first)")
    b, t, d = z_BTD.shape
    y_ND = norm(z_BTD, layer["ffn_norm"], cfg).reshape(b * t, d)
    logits_NX = dense(y_ND, layer["router"], preferred_element_type=jnp.promote_types(y_ND.dtype, jnp.float32))
    ids_NK, w_NK = route(logits_NX, layer["router_offset"], cfg.moe_top_k, router=cfg.router, eps=cfg.router_eps)
    out_ND = routed_experts(y_ND, ids_NK, w_NK, layer, impl, interpret)
    if cfg.n_shared_experts:  # always run, summed without normalisation (M20 §15)
        out_ND = out_ND + shared_experts(y_ND, layer["shared_gate"], layer["shared_up"], layer["shared_down"])
    out_BTD = post_norm(out_ND.reshape(b, t, d), layer, "post_ffn_norm", cfg)
    return z_BTD + out_BTD, {"router_offset": expert_load(ids_NK, cfg.n_experts)}
