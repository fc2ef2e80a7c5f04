"""Counting: parameters, mixture-of-experts stored vs active, LoRA adapters, training FLOPs, KV-cache size.

Every count is an exact integer formula with the seed's worked numbers as tests: U19 §3 (the tower,
12Ld² + Vd, experts), §6 (KV cache), §8 (C ≈ 6ND), §10 (LoRA 2dr), M20 §8 (parameter inventory) and
M20 §14 (2Lt·h_kv·d_h cached scalars).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import numpy as np

from mlx_llm.config import PARAM_COUNTS, ModelConfig
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.layers import layout


def _count(name: str, value, *, minimum: int = 1) -> int:
    """A count argument: an integer >= ``minimum`` (bools rejected), returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InputError(f"{name} = {value!r} is invalid: it must be an integer >= {minimum}")
    return int(value)


# ----- parameters ---------------------------------------------------------------------------------

def minillm_params(cfg: ModelConfig) -> int:
    """Parameters of the dense MiniLLM, M20 §8: n_E·V·d + L(2d·h_q·d_h + 2d·h_kv·d_h + 3dm + 2d) + d."""
    return cfg.param_count()


def tree_size(params) -> int:
    """Number of scalars in a parameter pytree (what ``minillm_params`` must equal)."""
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(params)))


def gpt2_block_params(d: int) -> int:
    """One GPT-2 block, U19 §3: attention 4d² + 4d, feed-forward (d → 4d → d) 8d² + 5d, two layer norms 4d."""
    d = _count("d", d)
    return 12 * d * d + 13 * d


def gpt2_params(d: int, L: int, V: int, context: int, tied: bool = True) -> int:
    """GPT-2 (U19 §3): L(12d² + 13d) + Vd (+ Vd more untied) + context·d (positions) + 2d (final norm).

    GPT-2 small (d=768, L=12, V=50 257, context 1 024, tied): 124 439 808.
    """
    L, V, context = _count("L", L), _count("V", V), _count("context", context)
    n_tables = 1 if tied else 2
    return L * gpt2_block_params(d) + n_tables * V * d + context * d + 2 * d


def approx_params(d: int, L: int, V: int) -> int:
    """The rule of thumb of U19 §3: 12Ld² (4d² attention + 8d² feed-forward per floor) + Vd (one shared table)."""
    d, L, V = _count("d", d), _count("L", L), _count("V", V)
    return 12 * L * d * d + V * d


class MoECount(NamedTuple):
    """Stored numbers (memory follows this) and numbers one token uses (compute follows this), U19 §3."""

    stored: int
    active: int


def moe_ffn_params(d: int, n_experts: int, top_k: int, *, expert_params: int | None = None,
                   router: bool = False) -> MoECount:
    """One mixture-of-experts feed-forward layer (U19 §3): E experts stored, top-k run per token.

    Each expert defaults to a GPT-style room of 8d² numbers; ``router=True`` adds the d×E router, which
    every token uses. d=4 096, 8 experts, top 2: 1 073 741 824 stored, 268 435 456 active.
    """
    d, n_experts = _count("d", d), _count("n_experts", n_experts)
    top_k = _count("top_k", top_k)
    if top_k > n_experts:
        raise ConfigError(f"top_k = {top_k} is invalid: it must be in [1, n_experts = {n_experts}]")
    one = 8 * d * d if expert_params is None else _count("expert_params", expert_params)
    extra = d * n_experts if router else 0
    return MoECount(stored=n_experts * one + extra, active=top_k * one + extra)


def moe_params(d: int, L: int, V: int, n_experts: int, top_k: int, *, router: bool = False) -> MoECount:
    """A 12Ld² + Vd tower whose feed-forward rooms are MoE layers: L(4d² + MoE) + Vd, stored and active.

    U19 §3's widget (d=4 096, L=32, V=32 000, 8 experts, top 2): about 36.64 billion stored,
    10.87 billion active.
    """
    d, L, V = _count("d", d), _count("L", L), _count("V", V)
    ffn = moe_ffn_params(d, n_experts, top_k, router=router)
    attention, table = 4 * d * d, V * d
    return MoECount(stored=L * (attention + ffn.stored) + table, active=L * (attention + ffn.active) + table)


def lora_params(d_in: int, d_out: int, r: int) -> int:
    """A rank-r adapter ΔW = BA on a d_in×d_out matrix (U19 §10): r(d_in + d_out) numbers, 2dr when square."""
    return _count("r", r) * (_count("d_in", d_in) + _count("d_out", d_out))


def lora_model_params(d: int, L: int, r: int, n_matrices: int = 2) -> int:
    """Adapters on ``n_matrices`` d×d matrices (query and value by default) in each of L layers: L·n·2dr.

    U19 §10: d=4 096, L=32, r=8 on W_Q and W_V gives 4 194 304.
    """
    return _count("L", L) * _count("n_matrices", n_matrices) * lora_params(d, d, r)


def lora_minillm_params(cfg: ModelConfig, r: int, targets: tuple[str, ...] = ("wq", "wv")) -> int:
    """Adapters on the named projections of every layer that has them (DESIGN §1 layout): r(d_in + d_out) each.

    In the dense MiniLLM W^Q and W^O are d × h_q·d_h (either way round), W^K and W^V are d × h_kv·d_h, gate/up
    d × m, down m × d: L·Σ_t r(d_in + d_out). The matrices are those of the LoRA targets ``layers.layout``
    declares (``lora_in`` input axes, the rest outputs), the same that ``post.lora`` adapts.
    """
    per_layer = [_lora_shapes(cfg, kinds) for kinds in (cfg.layer_kinds(l) for l in range(cfg.n_layers))]
    valid = set().union(*per_layer)
    unknown = [t for t in targets if t not in valid]
    if unknown or not targets:
        raise ConfigError(f"LoRA targets {list(targets)!r} are invalid: choose one or more of {sorted(valid)}")
    return sum(lora_params(*shapes[t], r) for shapes in per_layer for t in targets if t in shapes)


def _lora_shapes(cfg: ModelConfig, kinds: tuple[str, str]) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of every LoRA target of one layer of the given (mixer, FFN) kinds."""
    infos = {**layout.KINDS[kinds[0]], **layout.KINDS[kinds[1]]}
    return {k: layout.matrix_shape(i, layout.shape(i, cfg)) for k, i in infos.items() if i.lora_in is not None}


# ----- compute ------------------------------------------------------------------------------------

def training_flops(N, D):
    """C ≈ 6ND (U19 §8): 2N per token forward, 4N backward. Chinchilla (70B, 1.4T): 5.88e23."""
    N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
    if np.any(~(N > 0)) or np.any(~(D > 0)):
        raise InputError(f"training_flops needs N > 0 and D > 0; got N = {N!r}, D = {D!r}")
    out = 6.0 * N * D
    return float(out) if out.ndim == 0 else out


def matmul_params(cfg: ModelConfig) -> int:
    """Weights one token uses in a matrix product: Σ_ℓ (mixer_ℓ + FFN_ℓ) + dV, active weights only.

    Dense: L(2d·h_q·d_h + 2d·h_kv·d_h + 3dm) + dV. An MoE layer counts its router dX and the k routed plus S
    shared experts a token runs, 3d·m_e each (M20 §15, U19 §3). The embedding lookup is a gather (no
    multiply-adds) and is left out; the output projection Λ = RU is a real d×V product whether or not U = Eᵀ,
    so it is counted once either way. Norm gains are elementwise. A Mamba layer counts its projections
    in_x, in_z (2dI), w_dt and dt_proj (2IR), w_B and w_C (2IN) and out_proj (Id); its depthwise conv, biases,
    A_log and D act elementwise, and the scan's own work (a few operations per (i, n) per token) is not a
    weight product either. Which arrays are matrix-product weights is their role in ``layers.layout``.

    The knobs: a ReLU² FFN has 2dm (no gate), a GeGLU 3dm; ``mtp_depth`` D adds, per module, its projection 2d²,
    one layer of the stack's last kinds and another d×V output product (training only: generation runs none).
    Value embeddings are lookups, soft caps, sandwich norms, gates and U-net skips elementwise: none counts.
    """
    unembedding = cfg.d_model * cfg.vocab_size
    mtp = layout.mtp_count(cfg, active=True, roles=("matmul",)) + cfg.mtp_depth * unembedding
    return unembedding + layout.stack_count(cfg, active=True, roles=("matmul",)) + mtp


def mamba_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one Mamba mixer used in matrix products: 2dI + 2IR + 2IN + Id = 3dI + 2I(R + N) (the
    "matmul" arrays of ``layers.layout.MAMBA``)."""
    return layout.count(layout.MAMBA, cfg, roles=("matmul",))


def mixer_layers(cfg: ModelConfig, kind: str) -> int:
    """How many layers of the stack have a mixer of ``kind`` ("attn", "mamba")."""
    return sum(cfg.layer_kinds(l)[0] == kind for l in range(cfg.n_layers))


def attention_layers(cfg: ModelConfig) -> int:
    """How many layers of the stack are attention mixers (full or sliding-window)."""
    return mixer_layers(cfg, "attn") + mixer_layers(cfg, "local")


def keys_per_query(cfg: ModelConfig, kind: str, seq_len: int, *, causal: bool) -> float:
    """Mean keys one query of a ``kind`` layer reads in a window of ``seq_len`` positions: T for the full
    score matrix (``causal`` false: what ``ops.attention`` computes); (T+1)/2 causal; a sliding window W
    reads min(t+1, W) keys at position t."""
    T = seq_len
    if not causal:
        return float(T)
    w = cfg.window(kind)
    if w is None or w >= T:
        return (T + 1) / 2
    return (w * (w + 1) / 2 + (T - w) * w) / T


def train_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward) for windows of ``seq_len`` tokens.

    6·N_mm + 12·L_attn·T·h_q·d_h, with N_mm = ``matmul_params(cfg)`` (active weights): a weight costs 2 FLOPs
    per token forward and 4 backward (U19 §8), and per attention layer the scores QKᵀ and the mix AV each cost
    2·T·h_q·d_h FLOPs per query forward, so 4·T·h_q·d_h forward, 12·T·h_q·d_h for training (the form of
    PaLM's 6N + 12LHQT).

    ``causal=False`` counts the full T×T score matrix, which is what ``ops.attention`` computes (masked
    entries are computed, then discarded): use it for achieved FLOP/s. ``causal=True`` counts only the
    unmasked entries, (T+1)/2 keys per query on average: 6·N_mm + 6·L·(T+1)·h_q·d_h. The MTP modules' attention
    layers (``mtp_depth``) count like the stack's.
    """
    T = _count("seq_len", seq_len)
    keys = sum(mixer_layers(cfg, kind) * keys_per_query(cfg, kind, T, causal=causal) for kind in ("attn", "local"))
    mtp_mixer = layout.mtp_kinds(cfg)[0]
    if cfg.mtp_depth and mtp_mixer in ("attn", "local"):
        keys += cfg.mtp_depth * keys_per_query(cfg, mtp_mixer, T, causal=causal)
    attention = 12 * keys * cfg.n_heads * cfg.d_head if keys else 0
    return float(6 * matmul_params(cfg) + attention)


# ----- KV cache -----------------------------------------------------------------------------------

def kv_rows(n: int, cached: bool) -> int:
    """Rows of keys/values one layer computes to write n tokens (U19 §6): n with a cache, n(n+1)/2 without."""
    n = _count("n", n, minimum=0)
    return n if cached else n * (n + 1) // 2


class KVShape(NamedTuple):
    """The three numbers a KV cache depends on, for models that are not a ``ModelConfig``."""

    n_layers: int
    n_kv_heads: int
    d_head: int


def _kv_shape(model) -> KVShape:
    if isinstance(model, ModelConfig):  # only attention layers keep keys and values
        n_attn = attention_layers(model)
        return KVShape(n_attn, model.n_kv_heads or 1, model.d_head or 1) if n_attn else KVShape(0, 1, 1)
    if isinstance(model, tuple) and len(model) == 3:
        return KVShape(*(_count(name, v) for name, v in zip(KVShape._fields, model)))
    raise InputError(f"expected a ModelConfig or KVShape(n_layers, n_kv_heads, d_head); got {model!r}")


def kv_cache_scalars(model, seq_len: int, batch: int = 1) -> int:
    """Cached scalars after ``seq_len`` tokens (M20 §14): 2·L·t·h_kv·d_h per sequence, times ``batch``; a
    sliding-window layer holds min(t, W) positions (its ring buffer), not t.

    The 2 is one key and one value. M20's running example after its three inputs: 12.
    """
    shape = _kv_shape(model)
    t, b = _count("seq_len", seq_len, minimum=0), _count("batch", batch)
    if isinstance(model, ModelConfig) and mixer_layers(model, "local"):  # a ring buffer of W slots per local layer
        rows = mixer_layers(model, "attn") * t + mixer_layers(model, "local") * min(t, model.sliding_window)
        return 2 * rows * shape.n_kv_heads * shape.d_head * b
    return 2 * shape.n_layers * t * shape.n_kv_heads * shape.d_head * b


def bytes_per_scalar(dtype) -> int:
    """Bytes of one number: an int is taken as the byte count; anything NumPy reads as a dtype is converted."""
    if isinstance(dtype, numbers.Integral) and not isinstance(dtype, bool):
        return _count("bytes per scalar", dtype)
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        raise InputError(f"dtype = {dtype!r} is neither a dtype nor a number of bytes per scalar") from None


def kv_cache_bytes(model, seq_len: int, batch: int = 1, dtype="float32") -> int:
    """KV-cache bytes (U19 §6): 2·L·t·h_kv·d_h·b·batch, b = bytes per scalar (a dtype or an int).

    7B-class (L=32, 32 heads of 128), 4 096 tokens, 2 bytes: 2 GiB with 32 KV heads, 512 MiB with 8,
    64 MiB with 1. Runtime overhead (allocator padding, page tables) is not included.
    """
    return kv_cache_scalars(model, seq_len, batch) * bytes_per_scalar(dtype)


def pages_needed(lengths, page_size: int) -> int:
    """Pages a paged KV cache (``decode/cache.PagedKVCache``) gives sequences of these ``lengths``: ⌈n/page⌉ each
    (a partly filled last page is a whole page), none for an empty one."""
    size = _count("page_size", page_size)
    return sum(-(-_count("length", n, minimum=0) // size) for n in lengths)


def paged_kv_bytes(model, pages: int, page_size: int, dtype="float32") -> int:
    """Bytes of a paged KV pool: 2·L_full·P·page·h_kv·d_h·b — every full-attention layer's P pages of ``page_size``
    positions (the padding page is one of the P), whatever the sequences hold; sliding-window layers keep their
    ring of W slots per sequence outside the pool (``kv_cache_bytes`` counts them)."""
    shape = _kv_shape(model)
    full = mixer_layers(model, "attn") if isinstance(model, ModelConfig) else shape.n_layers
    rows = _count("pages", pages) * _count("page_size", page_size)
    return 2 * full * rows * shape.n_kv_heads * shape.d_head * bytes_per_scalar(dtype)


def ssm_state_scalars(cfg: ModelConfig, batch: int = 1) -> int:
    """Decode-state scalars of the Mamba layers, constant in the prefix length (M20 §19): per layer the conv
    window (W−1)·I and the SSM state I·N, times ``batch``."""
    conv, ssm = _mamba_state_scalars(cfg, _count("batch", batch))
    return conv + ssm


def _mamba_state_scalars(cfg: ModelConfig, batch: int) -> tuple[int, int]:
    """(conv-window scalars, SSM-state scalars) of all Mamba layers for ``batch`` rows."""
    n_mamba, inner = mixer_layers(cfg, "mamba"), cfg.ssm_expand * cfg.d_model
    return n_mamba * (cfg.ssm_conv - 1) * inner * batch, n_mamba * inner * cfg.ssm_state * batch


def decode_state_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, dtype="float32") -> int:
    """Bytes of the whole decode state after ``seq_len`` tokens: the KV cache of the attention layers (grows
    with t) plus the Mamba layers' conv windows and SSM states (do not). The SSM state is kept in at least
    float32, the conv window in ``dtype``."""
    conv, ssm = _mamba_state_scalars(cfg, _count("batch", batch))
    size = bytes_per_scalar(dtype)
    return kv_cache_bytes(cfg, seq_len, batch, dtype) + conv * size + ssm * max(size, 4)


# ----- sizing a run by compute ------------------------------------------------------------------------------


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} = {value!r} is invalid: it must be a finite number > 0")
    return float(value)


def steps_for_flops(cfg: ModelConfig, seq_len: int, batch_size: int, target_flops: float) -> int:
    """Optimizer steps that spend ``target_flops`` of training compute: C / (F·B·T) rounded to the nearest
    step (at least 1), F = ``train_flops_per_token(cfg, T)``, the exact count of what a step computes (full
    score matrices), and B·T the tokens of one step. The same on every machine (``--target-flops``)."""
    c = _positive("target_flops", target_flops)
    tokens = _count("batch_size", batch_size) * _count("seq_len", seq_len)
    return max(1, round(c / (train_flops_per_token(cfg, seq_len) * tokens)))


def param_count(cfg: ModelConfig, which: str = "non_embedding") -> int:
    """N of ``PARAM_COUNTS``: the non-embedding count (Kaplan et al. 2020), the whole θ, or the active one."""
    counts = {"non_embedding": cfg.non_embedding_param_count, "total": cfg.param_count,
              "active": cfg.active_param_count}
    if which not in counts:
        raise ConfigError(f"param_count = {which!r} is invalid: valid counts are {list(PARAM_COUNTS)}")
    return counts[which]()


def steps_for_tokens_per_param(cfg: ModelConfig, seq_len: int, batch_size: int, ratio: float,
                               which: str = "non_embedding") -> int:
    """Optimizer steps that read ``ratio`` tokens per parameter (20 is Chinchilla's compute-optimal ratio,
    U19 §8): R·N / (B·T) rounded to the nearest step (at least 1), N = ``param_count(cfg, which)``."""
    r = _positive("tokens_per_param", ratio)
    tokens = _count("batch_size", batch_size) * _count("seq_len", seq_len)
    return max(1, round(r * param_count(cfg, which) / tokens))
