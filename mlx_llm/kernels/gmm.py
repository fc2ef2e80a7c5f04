"""The grouped matrix product of the MoE experts (M20 §15; DESIGN §6), on the accelerator paths.

A grouped product multiplies rows sorted by group by their group's matrix: with the X groups owning consecutive
runs of rows (group e the next ``group_sizes[e]`` rows), out[r] = x[r] · w[e(r)]. It is the whole of dropless MoE
dispatch once the N·k (token, expert) assignments are sorted by expert (MegaBlocks, Gale et al. 2023), and it
spends only the active FLOPs, without the block padding of ``layers/moe.py``'s "block" path:

- "ragged_dot": ``jax.lax.ragged_dot``, the GPU path. XLA:CPU lowers it to a masked dense product with every
  group on every row (X× the FLOPs), which is why "block" stays the CPU path; so does the TPU compiler of this
  jax (a convolution over all X groups and a select: ``cost_analysis`` gives X× the active FLOPs on a v5e
  topology), which is why megablox is the TPU path.
- "megablox": the TPU Pallas kernel ``jax.experimental.pallas.ops.tpu.megablox.gmm`` (Mosaic), with its own
  custom VJP (``gmm`` with the weights transposed for dx, the transposed grouped product ``tgmm`` for dw).
  XLA's SPMD partitioner cannot split a Mosaic custom call, so under a mesh ``grouped_expert_ffn`` runs it
  inside ``jax.shard_map`` with the tokens split over the batch axes and the expert weights whole. ragged_dot
  runs the same way: left to the partitioner, the global sort all-gathers the tokens and every device computes
  the experts of the whole batch.

``interpret=True`` runs the megablox kernel in Pallas interpret mode on any backend (tests); that interpreter
fails on int32/int64 mismatches when ``jax_enable_x64`` is on, so interpret mode asks for x64 off.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlx_llm.errors import ConfigError, InputError

GMM_IMPLS = ("ragged_dot", "megablox")
BATCH_AXES = ("data", "fsdp")  # the mesh axes that split batch rows (train/parallel.py)
# megablox tiles: rows per tile (each group boundary inside a tile costs one more tile visit, so at most X − 1
# extra tiles), and the lane tiles of D and F (multiples of 128, the TPU lane width; larger ones mean fewer grid
# steps). Not tuned on hardware; megablox's own default is 128³.
TILE_M, TILE_LANE = 128, 512


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def megablox_tiling(m: int, d: int, f: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for x (m, d) times w (X, d, f). Rows: ``TILE_M``, or all m rounded up to 16 (the bf16 sublane
    packing) when fewer, so that the padded M is one whole tile, a block shape Mosaic accepts whatever its size
    (tgmm puts M on the lane axis). D and F: a multiple of 128 up to ``TILE_LANE``; the backward passes swap the
    roles of D and F, so both must be lane-legal, and megablox masks the ragged last tile."""
    tm = min(TILE_M, _round_up(m, 16))
    return tm, min(TILE_LANE, _round_up(d, 128)), min(TILE_LANE, _round_up(f, 128))


def _ragged_dot(x_MD, w_XDF, sizes_X):
    """``jax.lax.ragged_dot`` accumulating in at least float32, returned in x's dtype."""
    acc = jnp.promote_types(x_MD.dtype, jnp.float32)
    return jax.lax.ragged_dot(x_MD, w_XDF, sizes_X, preferred_element_type=acc).astype(x_MD.dtype)


def _megablox(x_MD, w_XDF, sizes_X, interpret: bool):
    """megablox ``gmm`` on shapes it accepts: M padded to a whole number of row tiles. The padding rows, and any
    rows beyond Σ sizes, are zeroed and given to the last group, so every output tile is written (megablox
    leaves rows of no group unwritten) and they add nothing to the weight gradient; they are sliced off."""
    for a in (x_MD, w_XDF):
        if a.dtype not in (jnp.float32, jnp.bfloat16):
            raise InputError(f"grouped_matmul: megablox takes float32 or bfloat16 arrays, got {a.dtype}; "
                             f"use impl 'ragged_dot' for other dtypes")
    if interpret and jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int64:  # x64 on, here
        raise ConfigError("grouped_matmul: megablox in interpret mode does not run with jax_enable_x64 on (the "
                          "Pallas interpreter mixes int32 and int64 indices); disable x64 around the call")
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm  # Pallas TPU, loaded when used

    m, d = x_MD.shape
    tiling = megablox_tiling(m, d, w_XDF.shape[-1])
    m_pad = _round_up(m, tiling[0])
    used = jnp.sum(sizes_X)
    x_MD = jnp.where(jnp.arange(m)[:, None] < used, x_MD, jnp.zeros((), x_MD.dtype))
    x_MD = jnp.pad(x_MD, ((0, m_pad - m), (0, 0)))
    sizes_X = sizes_X.at[-1].add(m_pad - used)
    out_MF = megablox_gmm(x_MD, w_XDF, sizes_X, x_MD.dtype, tiling, None, None, False, interpret)
    return out_MF[:m]


def grouped_matmul(x_MD, w_XDF, group_sizes_X, *, impl: str, interpret: bool = False):
    """out[r] = x[r] · w[e(r)] (M, F) for rows of x (M, D) sorted by group, group e owning the next
    ``group_sizes_X[e]`` rows (Σ ≤ M; rows beyond the groups give zeros). Differentiable w.r.t. x and w;
    accumulates in float32 (or wider) and returns x's dtype."""
    sizes_X = group_sizes_X.astype(jnp.int32)
    if impl == "ragged_dot":
        return _ragged_dot(x_MD, w_XDF, sizes_X)
    if impl == "megablox":
        return _megablox(x_MD, w_XDF, sizes_X, interpret)
    raise ConfigError(f"grouped_matmul: impl = {impl!r} is invalid: valid impls are {list(GMM_IMPLS)}")


def _sorted_swiglu(y_ND, ids_NK, weights_NK, w_gate_XDF, w_up_XDF, w_down_XFD, impl: str, interpret: bool):
    """Σ_{e∈S(y)} w_e F_e(y) by sorting the N·k assignments by expert (stable, so equal experts keep token
    order), three grouped products with SiLU(gate) ⊙ up between them (M20 §7), unsorting and mixing."""
    n, d = y_ND.shape
    k = ids_NK.shape[-1]
    flat = ids_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes_X = jnp.zeros((w_gate_XDF.shape[0],), jnp.int32).at[flat].add(1)  # expert load
    gmm = lambda x, w: grouped_matmul(x, w, sizes_X, impl=impl, interpret=interpret)
    rows_MD = y_ND[order // k]
    c_MF = jax.nn.silu(gmm(rows_MD, w_gate_XDF)) * gmm(rows_MD, w_up_XDF)
    out_MD = gmm(c_MF, w_down_XFD)
    w_M = weights_NK.reshape(-1)[order].astype(out_MD.dtype)
    out_NKD = jnp.zeros((n * k, d), out_MD.dtype).at[order].set(out_MD * w_M[:, None], unique_indices=True)
    return out_NKD.reshape(n, k, d).sum(axis=1)


def _token_axes(mesh) -> tuple[str, ...]:
    """The batch axes of ``mesh`` that split tokens: present, larger than 1 and not already manual."""
    manual = set(mesh.manual_axes)
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)


def _per_shard(fn, mesh, n: int):
    """``fn`` (tokens, ids, weights, 3 expert tensors) under ``jax.shard_map`` over every non-manual axis of
    ``mesh``: tokens split over its batch axes (whole on every shard when n does not divide, like the attention
    kernels), expert weights whole on every shard. Each shard sorts its own assignments; that is exact because a
    token's output depends on that token alone."""
    axes = _token_axes(mesh)
    if n % math.prod(mesh.shape[a] for a in axes):
        axes = ()
    tok = P(axes or None, None)
    free = frozenset(mesh.axis_names) - set(mesh.manual_axes)
    # check_vma=False: megablox's pallas_call declares no varying-axes type for its output, which the check
    # needs; without it, shard_map's transpose still sums the replicated weights' cotangents over the shards.
    return jax.shard_map(fn, mesh=mesh, in_specs=(tok, tok, tok, P(), P(), P()), out_specs=tok,
                         axis_names=free, check_vma=False)


def grouped_expert_ffn(y_ND, ids_NK, weights_NK, w_gate_XDF, w_up_XDF, w_down_XFD, *, impl: str,
                       interpret: bool = False):
    """Σ_{e∈S(y)} w_e F_e(y) for every row of y (N, D) (M20 §15, dropless), each F_e = SwiGLU(w_gate[e],
    w_up[e], w_down[e]) (M20 §7): the same numbers as ``layers.moe.expert_ffn`` with no padding blocks, so the
    grouped products ask for the active 2·N·k·D·F·3 FLOPs of the forward (megablox adds at most X − 1 row tiles
    per product; see the module docstring for ragged_dot). ``impl``: "ragged_dot" or "megablox". Under an abstract
    mesh (``jax.set_mesh``) both run per token shard inside ``jax.shard_map`` (``_per_shard``)."""
    if impl not in GMM_IMPLS:
        raise ConfigError(f"grouped_expert_ffn: impl = {impl!r} is invalid: valid impls are {list(GMM_IMPLS)}")
    fn = on_token_shards(lambda *a: _sorted_swiglu(*a, impl=impl, interpret=interpret), y_ND.shape[0])
    return fn(y_ND, ids_NK, weights_NK, w_gate_XDF, w_up_XDF, w_down_XFD)


def on_token_shards(fn, n: int):
    """``fn`` (tokens, ids, weights, 3 expert tensors) run per token shard (``_per_shard``) under an abstract mesh
    of several devices (``jax.sharding.use_abstract_mesh``, set by the train step), else ``fn`` itself. Every
    dispatch sorts its rows, and a sort of the global batch makes the partitioner gather every token to every
    device (measured: the block path's compiled FLOPs were 6.04x active on 4 devices, 1.51x on one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and len(mesh.manual_axes) < len(mesh.axis_names):
        return _per_shard(fn, mesh, n)
    return fn
