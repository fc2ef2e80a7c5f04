"""The parameter layout of DESIGN §1, declared once per layer kind: every array's shape, initialiser, role,
tensor-parallel axis and LoRA form, in one table per kind ("attn", "mamba", "swiglu", "moe", "none") and one
for the top level (``embed``, ``final_norm``, ``unembed``).

Everything else that depends on the layout is derived from these tables: each layer's ``init`` (through layers/initializers.py) and the number
of random draws ``model.init_params`` splits its key into (``init_table``, ``draws``), the tensor axis of
``train.parallel.param_spec`` (``tensor_axes``), the LoRA targets (``lora_targets``), the parameter counts of
``ModelConfig`` and ``scaling.accounting`` (``count``, ``stack_count``) and the whole tree's shapes
(``param_shapes``). Adding a weight means adding one ``ParamInfo`` here (and using it in the layer's forward).

Shapes are per layer (no stacked L axis) and name their dimensions (``DIMS``): V vocab, D model width, H query
heads, G key/value heads, K head width, F FFN width, X routed experts, S shared experts, M expert width
(``moe_d_ff``), I SSM inner width, N state size, W conv width, R Δ rank, k experts a token runs.

Initialisers (the reasons are in ``model``'s docstring): projections N(0, 1/fan_in), the residual writers
(W^O, W_down, the experts' down projections, Mamba's out_proj) also × 1/√(2·n_layers) (GPT-2), or 0 under
``zero_init_out``; norm gains 1 (M20 §4), or w = 0 under ``norm_unit_offset`` (γ = 1 + w); Mamba as published (Gu & Dao 2023): A_log from S4D-real, D = 1, conv_b = 0, Δ log-uniform through
``dt_bias``; MoE offsets 0 (M20 §15). Each array with a ``std`` takes exactly one N(0, std²) draw, in table
order (the order of the keys), so a table fixes the key stream: reordering it changes every seed's parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

# Dimension name → ModelConfig field ("I" is computed: ``ssm_inner`` if the object has one, else ssm_expand·d).
DIMS = {"V": "vocab_size", "D": "d_model", "H": "n_heads", "G": "n_kv_heads", "K": "d_head", "F": "d_ff",
        "X": "n_experts", "S": "n_shared_experts", "M": "moe_d_ff", "k": "moe_top_k", "N": "ssm_state",
        "W": "ssm_conv", "R": "ssm_dt_rank"}
# table: embedding / unembedding; matmul: a weight of a matrix product x·W; elementwise: depthwise conv, biases,
# A_log, D; norm: an RMSNorm gain (no weight decay); state: routing state, not θ (no AdamW, not counted).
ROLES = ("table", "matmul", "elementwise", "norm", "state")
THETA = ("table", "matmul", "elementwise", "norm")  # the roles of trainable parameters θ
INITS = ("normal", "ones", "zeros")  # built in; any other name is a rule the layer's module supplies
# Learning-rate groups (``ParamInfo.lr_group``; train/masks.py ``role_lr_scales``): the input tables, the output
# head, the matrices, and the scalars (gains, biases, gates, Mamba's elementwise parameters).
LR_GROUPS = ("embed", "head", "matrix", "scalar")
_ROLE_GROUP = {"table": "embed", "matmul": "matrix", "elementwise": "scalar", "norm": "scalar", "state": None}


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One array of the layout.

    dims: the per-layer shape, as names of ``DIMS``. init: "normal" (the draw itself), "ones", "zeros", or the
    name of a rule the layer module passes to ``init_table`` (it receives the draw, if any). std: σ(cfg) of the
    one N(0, σ²) draw the array takes (None: no draw). role: one of ``ROLES``. tensor_axis: the axis (per layer)
    that the mesh's ``tensor`` axis splits (heads, FFN/expert/SSM width, vocabulary), or None (replicated).
    lora_in: as a LoRA target, how many leading axes are inputs (the rest are outputs), or None (not a target).
    routed: axis 0 holds the X routed experts, of which one token runs k (active counts). present: whether the
    array exists for a config (None: always); an array with a zero-size dimension is absent too. decay: whether
    AdamW's weight decay applies, where the role alone does not decide it (None: ``decayed``'s rule).
    zero_if: a config predicate under which the array starts at zero instead (its draw is still taken, so the
    key stream of the others is unchanged). extra: its draw comes from the second key stream ``model.init_params``
    keeps for arrays added by the knobs (value embeddings, MTP modules), not from the main split, so the main
    stream — every seed's parameters without those knobs — is the same whether the layout declares them or not.
    group: its learning-rate group where the role alone does not decide it (None: ``lr_group``'s rule).
    """

    dims: tuple[str, ...]
    init: str = "normal"
    std: Callable[[Any], float] | None = None
    role: str = "matmul"
    tensor_axis: int | None = None
    lora_in: int | None = None
    routed: bool = False
    present: Callable[[Any], bool] | None = None
    decay: bool | None = None
    zero_if: Callable[[Any], bool] | None = None
    extra: bool = False
    group: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"ParamInfo role {self.role!r} is invalid: valid roles are {list(ROLES)}")
        if self.init in ("ones", "zeros") and self.std is not None:
            raise ValueError(f"ParamInfo init {self.init!r} takes no random draw, but std is set")
        if self.init == "normal" and self.std is None:
            raise ValueError("ParamInfo init 'normal' needs a std")
        if self.group is not None and self.group not in LR_GROUPS:
            raise ValueError(f"ParamInfo group {self.group!r} is invalid: valid groups are {list(LR_GROUPS)}")
        for axis, low in ((self.tensor_axis, 0), (self.lora_in, 1)):  # LoRA keeps ≥ 1 input and ≥ 1 output axis
            if axis is not None and not low <= axis < len(self.dims):
                raise ValueError(f"ParamInfo axis {axis} is outside the {len(self.dims)} axes of {self.dims}")

    @property
    def draws(self) -> bool:
        """Whether the array takes a draw from the main key stream."""
        return self.std is not None and not self.extra

    @property
    def lr_group(self) -> str | None:
        """The learning-rate group (``LR_GROUPS``): ``group`` if declared, else by role — tables "embed",
        matmul weights "matrix", gains and elementwise parameters "scalar"; routing state has none."""
        return self.group if self.group is not None else _ROLE_GROUP[self.role]

    @property
    def decayed(self) -> bool:
        """AdamW's weight decay applies to exactly the weight matrices (M20 §12 decays "the matrices", not the
        normalisation gains): the tables and the matmul weights, and Mamba's depthwise convolution kernel
        (``decay=True``: the weight of a linear map, as the published Mamba training decays it); never a norm
        gain, a bias, Mamba's A_log or D (which Gu & Dao's code marks ``_no_weight_decay``), or routing state."""
        return self.role in ("table", "matmul") if self.decay is None else self.decay


# ----- initial scales ---------------------------------------------------------------------------------------
def fan_in(*dims: str, residual: bool = False) -> Callable[[Any], float]:
    """σ = 1/√fan_in, fan_in = the product of ``dims``; a residual writer also × 1/√(2·n_layers) (GPT-2)."""

    def std(cfg) -> float:
        fan = math.prod(dim(n, cfg) for n in dims)
        if residual:
            return (1.0 / math.sqrt(2 * cfg.n_layers)) / math.sqrt(fan)
        return 1 / math.sqrt(fan)

    return std


def unit_std(cfg) -> float:
    """σ = 1 (a standard normal draw that a rule then transforms, e.g. Mamba's Δ)."""
    return 1.0


def embed_std(cfg) -> float:
    """E ~ N(0, 1) untied; N(0, 1/d) tied, where E is also the output projection (unit-scale logits). Under μP
    the tied table is an output weight of the base width: N(0, 1/d_base) (``mup_init_mult``'s rule)."""
    if not cfg.tie_embeddings:
        return 1.0
    return 1.0 / math.sqrt(cfg.d_model / width_mult("D", cfg))


def untied(cfg) -> bool:
    """``unembed`` exists only when the embeddings are untied (tied: U = Eᵀ)."""
    return not cfg.tie_embeddings


def _flag(name: str) -> Callable[[Any], bool]:
    """The predicate "ModelConfig field ``name`` is set" (absent fields count as unset)."""
    return lambda cfg: bool(getattr(cfg, name, False))


unit_offset, zero_out, sandwich, has_value_embeds, has_unet = (
    _flag("norm_unit_offset"), _flag("zero_init_out"), _flag("sandwich_norm"), _flag("value_embeds"),
    _flag("unet_skips"))


# ----- the declarations ---------------------------------------------------------------------------------
_NORM = ParamInfo(("D",), "ones", role="norm", zero_if=unit_offset)  # γ = 1, or w = 0 for γ = 1 + w
_POST_NORM = ParamInfo(("D",), "ones", role="norm", zero_if=unit_offset, present=sandwich)

TOP = {
    "embed": ParamInfo(("V", "D"), std=embed_std, role="table", tensor_axis=0),
    "final_norm": _NORM,
    "unembed": ParamInfo(("D", "V"), std=fan_in("D"), role="table", tensor_axis=1, present=untied, group="head"),
    # the U-net's skip weights w_0 … w_{L/2−1} (modded-nanogpt: init 1)
    "skip_weights": ParamInfo(("U",), "ones", role="elementwise", present=has_unet),
}

def has_qkv_bias(cfg) -> bool:
    return bool(getattr(cfg, "qkv_bias", False))


def has_qk_norm(cfg) -> bool:
    return bool(getattr(cfg, "qk_norm", False))


ATTN = {  # M20 §5–§6: Q = X W^Q, K = X W^K, V = X W^V per head; A = Concat(O) W^O
    "attn_norm": _NORM,
    "wq": ParamInfo(("D", "H", "K"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "wk": ParamInfo(("D", "G", "K"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "wv": ParamInfo(("D", "G", "K"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "wo": ParamInfo(("H", "K", "D"), std=fan_in("H", "K", residual=True), tensor_axis=0, lora_in=2,
                    zero_if=zero_out),
    # Qwen2's projection biases (zeros, no draw: the key stream of the other arrays is unchanged)
    "bq": ParamInfo(("H", "K"), "zeros", role="elementwise", tensor_axis=0, present=has_qkv_bias),
    "bk": ParamInfo(("G", "K"), "zeros", role="elementwise", tensor_axis=0, present=has_qkv_bias),
    "bv": ParamInfo(("G", "K"), "zeros", role="elementwise", tensor_axis=0, present=has_qkv_bias),
    # Qwen3's per-head RMSNorm gains on Q and K (over d_h, shared by the heads)
    "q_norm": ParamInfo(("K",), "ones", role="norm", present=has_qk_norm, zero_if=unit_offset),
    "k_norm": ParamInfo(("K",), "ones", role="norm", present=has_qk_norm, zero_if=unit_offset),
    "post_attn_norm": _POST_NORM,  # sandwich norms (Gemma 2/3): N_post of the attention output
    # value embeddings (modded-nanogpt): V = X W^V + λ·E^v[x], a table per layer and its gate λ (init 1/2)
    "value_embed": ParamInfo(("V", "G", "K"), std=unit_std, role="table", tensor_axis=1, present=has_value_embeds,
                             extra=True),
    "value_gate": ParamInfo((), "half", role="elementwise", present=has_value_embeds),
}

_W_UP = ParamInfo(("D", "F"), std=fan_in("D"), tensor_axis=1, lora_in=1)
_W_DOWN = ParamInfo(("F", "D"), std=fan_in("F", residual=True), tensor_axis=0, lora_in=1, zero_if=zero_out)

SWIGLU = {  # M20 §7: F(y) = (SiLU(y W_gate) ⊙ y W_up) W_down; GeGLU the same with GELU_tanh
    "ffn_norm": _NORM,
    "w_gate": ParamInfo(("D", "F"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "w_up": _W_UP,
    "w_down": _W_DOWN,
    "post_ffn_norm": _POST_NORM,
}

RELU2 = {  # squared ReLU (So et al. 2021; modded-nanogpt): F(y) = max(0, y W_up)² W_down
    "ffn_norm": _NORM,
    "w_up": _W_UP,
    "w_down": _W_DOWN,
    "post_ffn_norm": _POST_NORM,
}

MOE = {  # M20 §15, U19 §3: router, offsets, X routed and S shared SwiGLU experts (shared absent when S = 0)
    "ffn_norm": _NORM,
    "router": ParamInfo(("D", "X"), std=fan_in("D")),
    "router_offset": ParamInfo(("X",), "zeros", role="state"),
    "expert_gate": ParamInfo(("X", "D", "M"), std=fan_in("D"), tensor_axis=2, routed=True),
    "expert_up": ParamInfo(("X", "D", "M"), std=fan_in("D"), tensor_axis=2, routed=True),
    "expert_down": ParamInfo(("X", "M", "D"), std=fan_in("M", residual=True), tensor_axis=1, routed=True,
                             zero_if=zero_out),
    "shared_gate": ParamInfo(("S", "D", "M"), std=fan_in("D"), tensor_axis=2),
    "shared_up": ParamInfo(("S", "D", "M"), std=fan_in("D"), tensor_axis=2),
    "shared_down": ParamInfo(("S", "M", "D"), std=fan_in("M", residual=True), tensor_axis=1, zero_if=zero_out),
    "post_ffn_norm": _POST_NORM,
}

MAMBA = {  # M20 §19, Gu & Dao 2023 (layers/mamba.py): rules "dt_bias" and "A_log" come from mamba.init
    "ssm_norm": _NORM,
    "in_x": ParamInfo(("D", "I"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "in_z": ParamInfo(("D", "I"), std=fan_in("D"), tensor_axis=1, lora_in=1),
    "conv_w": ParamInfo(("W", "I"), std=fan_in("W"), role="elementwise", tensor_axis=1, decay=True),
    "conv_b": ParamInfo(("I",), "zeros", role="elementwise", tensor_axis=0),
    "w_dt": ParamInfo(("I", "R"), std=fan_in("I"), tensor_axis=0),
    "w_B": ParamInfo(("I", "N"), std=fan_in("I"), tensor_axis=0),
    "w_C": ParamInfo(("I", "N"), std=fan_in("I"), tensor_axis=0),
    "dt_proj": ParamInfo(("R", "I"), std=fan_in("R"), tensor_axis=1),
    "dt_bias": ParamInfo(("I",), "dt_bias", std=unit_std, role="elementwise", tensor_axis=0),
    "A_log": ParamInfo(("I", "N"), "A_log", role="elementwise", tensor_axis=0),
    "D": ParamInfo(("I",), "ones", role="elementwise", tensor_axis=0),
    "out_proj": ParamInfo(("I", "D"), std=fan_in("I", residual=True), tensor_axis=0, lora_in=1, zero_if=zero_out),
}

KINDS = {"attn": ATTN, "local": ATTN, "mamba": MAMBA, "swiglu": SWIGLU, "geglu": SWIGLU, "relu2": RELU2, "moe": MOE,
         "none": {}}


def mtp_proj_std(cfg) -> float:
    """σ = 1/√(2d) of each half of the MTP projection M [N(h); N(e)] (one fan-in of 2d, split in two)."""
    return 1 / math.sqrt(2 * cfg.d_model)


MTP = {  # DeepSeek-V3's MTP module k (model.mtp_hidden): h'^k = N(h^{k−1}) W_h + N(E[x_{t+k}]) W_e, then a layer
    "mtp_h_norm": _NORM,
    "mtp_e_norm": _NORM,
    "mtp_h_proj": ParamInfo(("D", "D"), std=mtp_proj_std, extra=True),
    "mtp_e_proj": ParamInfo(("D", "D"), std=mtp_proj_std, extra=True),
}

HEADS = {  # trained beside a model, not part of it: the reward model's r = w · R_last (U19 §11, post/reward.py)
    "reward_head": ParamInfo(("D",), "zeros"),  # and PPO's value V_t = w · R_t (post/ppo.py)
    "value_head": ParamInfo(("D",), "zeros"),
}


def entries() -> dict[str, ParamInfo]:
    """Every declared key → its ParamInfo (top level, then attn, swiglu, moe, mamba, the heads). A key that
    several kinds declare (``ffn_norm``) must mean the same there: its shape, role, tensor axis and LoRA form
    agree."""
    out: dict[str, ParamInfo] = {}
    for table in (TOP, ATTN, SWIGLU, RELU2, MOE, MAMBA, MTP, HEADS):
        for key, info in table.items():
            if key in out and out[key] != info:
                raise ValueError(f"layout key {key!r} is declared twice with different meanings")
            out[key] = info
    return out


# ----- shapes and counts ----------------------------------------------------------------------------------
def dim(name: str, cfg) -> int:
    """The size of dimension ``name`` (``DIMS``) for a config-like object."""
    if name == "I":
        inner = getattr(cfg, "ssm_inner", None)
        return cfg.ssm_expand * cfg.d_model if inner is None else inner
    if name == "U":  # the U-net's skip connections: one per layer of the first half
        return cfg.n_layers // 2
    return getattr(cfg, DIMS[name])


def shape(info: ParamInfo, cfg, *, active: bool = False) -> tuple[int, ...]:
    """The per-layer shape; ``active`` counts only the k of X routed experts one token runs."""
    return tuple(dim("k" if active and info.routed and n == "X" else n, cfg) for n in info.dims)


def present(info: ParamInfo, cfg) -> bool:
    """Whether the array is part of ``cfg``'s parameters (its predicate holds and no dimension is 0)."""
    return (info.present is None or info.present(cfg)) and math.prod(shape(info, cfg)) > 0


def count(table: dict[str, ParamInfo], cfg, *, active: bool = False, roles=THETA) -> int:
    """Scalars of one layer of a kind (or of the top level) in the given roles: Σ ∏ shape over present arrays."""
    return sum(math.prod(shape(info, cfg, active=active)) for info in table.values()
               if info.role in roles and present(info, cfg))


def stack_count(cfg, *, active: bool = False, roles=THETA) -> int:
    """``count`` summed over every layer of the stack: Σ_ℓ (mixer_ℓ + FFN_ℓ)."""
    return sum(count(KINDS[m], cfg, active=active, roles=roles) + count(KINDS[f], cfg, active=active, roles=roles)
               for m, f in (cfg.layer_kinds(l) for l in range(cfg.n_layers)))


def mtp_kinds(cfg) -> tuple[str, str]:
    """The (mixer, FFN) kinds of every MTP module's layer: those of the stack's last layer."""
    return cfg.layer_kinds(cfg.n_layers - 1)


def mtp_count(cfg, *, active: bool = False, roles=THETA) -> int:
    """Scalars of the ``mtp_depth`` D MTP modules: D·(MTP table + one layer of ``mtp_kinds``)."""
    depth = getattr(cfg, "mtp_depth", 0)
    if not depth:
        return 0
    m, f = mtp_kinds(cfg)
    return depth * sum(count(t, cfg, active=active, roles=roles) for t in (MTP, KINDS[m], KINDS[f]))


def matrix_shape(info: ParamInfo, shape_: tuple[int, ...]) -> tuple[int, int]:
    """(d_in, d_out) of a LoRA target's per-layer weight ``shape_``: its ``lora_in`` leading axes are inputs."""
    return math.prod(shape_[:info.lora_in]), math.prod(shape_[info.lora_in:])


def param_shapes(cfg) -> dict:
    """The shapes of the whole parameter tree of ``cfg`` (DESIGN §1): what ``model.init_params`` returns."""
    n_groups = cfg.n_layers // cfg.period

    def layer(table):
        return {k: (n_groups, *shape(i, cfg)) for k, i in table.items() if present(i, cfg)}

    groups = [{**layer(KINDS[m]), **layer(KINDS[f])} for m, f in cfg.group_kinds]
    top = {k: shape(i, cfg) for k, i in TOP.items() if present(i, cfg)}
    out = {"embed": top["embed"], "blocks": groups[0] if cfg.uniform else groups,
           **{k: v for k, v in top.items() if k != "embed"}}
    depth = getattr(cfg, "mtp_depth", 0)
    if depth:
        m, f = mtp_kinds(cfg)
        out["mtp"] = {"blocks": {k: (depth, *shape(i, cfg)) for table in (MTP, KINDS[m], KINDS[f])
                                 for k, i in table.items() if present(i, cfg)}}
    return out


# ----- derived tables --------------------------------------------------------------------------------------
def draws(table: dict[str, ParamInfo]) -> int:
    """Random draws one layer of a kind (or the top level) takes, absent arrays included (they keep the key
    stream of the others fixed: a tied ``unembed``'s key is reserved, S = 0 shared experts draw empty arrays)."""
    return sum(info.draws for info in table.values())


def tensor_axes() -> dict[str, int]:
    """Key → the per-layer axis the ``tensor`` mesh axis splits, for every key that has one."""
    return {k: i.tensor_axis for k, i in entries().items() if i.tensor_axis is not None}


def lora_targets() -> dict[str, int]:
    """LoRA target key → its number of input axes, for every weight LoRA may adapt."""
    return {k: i.lora_in for k, i in entries().items() if i.lora_in is not None}


# ----- μP: the maximal-update parametrization, from the same declarations ---------------------------------------
# Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer"
# (arXiv:2203.03466), Table 3 (μP for SGD and Adam), in the equivalent form with multipliers its appendix gives
# ("alternative (equivalent) μP formulation for easier implementation"), written relative to a base model so that at the base width μP is the standard parametrization
# (SP) exactly. The width of a dimension grows with d_model (``WIDTH_DIMS``); vocabulary, expert counts, state size
# and conv width are finite. docs/scaling-laws.md tables every rule with its source.
WIDTH_DIMS = ("D", "H", "G", "K", "F", "M", "I", "R")  # the dimensions that grow with the width
PARAMETRIZATIONS = ("sp", "mup")  # ModelConfig.parametrization
MUP_CLASSES = ("input", "hidden", "output", "vector")  # Yang et al.'s kinds of weights (their Table 3's columns)


def mup(cfg) -> bool:
    """Whether ``cfg`` is μP (a config-like object without the field is SP)."""
    return getattr(cfg, "parametrization", "sp") == "mup"


def width_mult(name: str, cfg) -> float:
    """m of dimension ``name``: how many times wider it is than in the base model (1 under SP and for finite
    dimensions). D, F, M, I, R: m = d_model / ``mup_base_width``; K (head width): d_head / ``mup_base_head_width``
    (1 when that is unset: the head width is then not a width); H, G (head counts): m / m_K, so that the attention
    width h·d_h grows as d_model does."""
    if not mup(cfg) or name not in WIDTH_DIMS:
        return 1.0
    m = cfg.d_model / cfg.mup_base_width
    m_head = cfg.d_head / cfg.mup_base_head_width if cfg.mup_base_head_width else 1.0
    return m_head if name == "K" else m / m_head if name in ("H", "G") else m


def fan_dims(info: ParamInfo) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input dims, output dims) of a weight: its ``lora_in`` leading dims (else the first) are what it contracts;
    a leading expert axis (X, S) is neither (one matrix per expert)."""
    dims = info.dims[1:] if info.dims and info.dims[0] in ("X", "S") else info.dims
    n_in = info.lora_in if info.lora_in is not None and len(dims) == len(info.dims) else 1
    return dims[:n_in], dims[n_in:]


def mup_class(info: ParamInfo) -> str:
    """Yang et al.'s kind of a parameter, from its declaration: "input" (a finite fan-in into a width: the
    embedding), "hidden" (width to width), "output" (a width into a finite fan-out: the unembedding, a router),
    "vector" (gains, biases, elementwise and state arrays: Table 3's "all biases")."""
    if info.role not in ("table", "matmul") or len(info.dims) < 2:
        return "vector"
    ins, outs = fan_dims(info)
    wide_in, wide_out = any(d in WIDTH_DIMS for d in ins), any(d in WIDTH_DIMS for d in outs)
    if wide_in and wide_out:
        return "hidden"
    return "output" if wide_in else "input" if wide_out else "vector"


def fan_mult(info: ParamInfo, cfg) -> tuple[float, float]:
    """(fan_in / base fan_in, fan_out / base fan_out) of a weight: the products of its dims' ``width_mult``."""
    ins, outs = fan_dims(info)
    return math.prod(width_mult(d, cfg) for d in ins), math.prod(width_mult(d, cfg) for d in outs)


def mup_init_mult(info: ParamInfo, cfg) -> float:
    """The factor on a declared σ under μP: √(fan_in/base fan_in) for an output weight, so that its σ is the base
    model's 1/√fan_in_base and, with the output multiplier 1/m, the effective weight has variance
    ∝ 1/fan_in² (Table 3, output weights; in the multiplier form the stored weight's variance is independent of
    width). 1 for everything else:
    hidden weights keep 1/fan_in (Table 3), input weights and vectors their own scale."""
    return math.sqrt(fan_mult(info, cfg)[0]) if mup_class(info) == "output" else 1.0


def output_mult(cfg) -> float:
    """The logits' multiplier α = base fan_in / fan_in of the unembedding (1/m; 1 under SP): Λ = α·R U (the
    multiplier form of Table 3: output weights × 1/fan_in, their Adam learning rate then independent of width)."""
    return 1.0 / fan_mult(TOP["unembed"], cfg)[0]


def attention_q_mult(cfg) -> float:
    """The factor on Q that turns the attention kernels' 1/√d_h into μP's logit scale (Yang et al. 2022, §4 and
    Appendix B.1: q·k/d instead of q·k/√d): with ``mup_base_head_width`` d_0 the scale is √d_0/d_h (1/√d_h at
    d_h = d_0, SP's), so Q is multiplied by √(d_0/d_h); without it the scale is 1/d_h, Q × 1/√d_h. 1 under SP."""
    if not mup(cfg):
        return 1.0
    return math.sqrt((cfg.mup_base_head_width or 1) / cfg.d_head)


def mup_lr_mult(info: ParamInfo, cfg, optimizer: str = "adamw") -> float:
    """The learning-rate multiplier of a declared parameter under μP (1 under SP).

    AdamW (Table 3, Adam): hidden weights η/m_in (m_in = fan_in / base fan_in); input weights, output weights
    (with the output multiplier of Table 9) and vectors η. Muon (``optimizer`` "muon" or "normuon", on the hidden weights it
    orthogonalises; Yang, Simon & Bernstein 2023, "A Spectral Condition for Feature Learning", arXiv:2310.17813,
    Condition 1: ‖ΔW‖_spectral = Θ(√(fan_out/fan_in))): Muon's update has spectral norm 0.2·√max(fan_in, fan_out)
    (Liu et al.'s scaling, train/muon.py), so the multiplier is √(fan_out/fan_in)/√max(fan_in, fan_out) over its
    value at the base shape: 1/√m when both fans grow by m. The rest of a Muon run is AdamW's."""
    if not mup(cfg) or mup_class(info) != "hidden":
        return 1.0
    m_in, m_out = fan_mult(info, cfg)
    if optimizer not in ("muon", "normuon"):
        return 1.0 / m_in
    ins, outs = fan_dims(info)
    fan_in, fan_out = math.prod(dim(d, cfg) for d in ins), math.prod(dim(d, cfg) for d in outs)
    base_in, base_out = fan_in / m_in, fan_out / m_out
    return math.sqrt((m_out / m_in) * max(base_in, base_out) / max(fan_in, fan_out))
