"""Our parameter pytree (DESIGN §1) ↔ transformers' tensor names and layouts, per architecture.

Our projections multiply on the right (X W, W of shape (in, out)); a torch ``nn.Linear`` stores (out, in) and
computes X Wᵀ, so every projection is transposed. Head axes are flattened head-major ((H, K) → H·K), which is how
transformers splits q/k/v/o into heads. Both directions only transpose, reshape and concatenate: the round trip
is exact bit for bit.

- Llama, Qwen2, Qwen3, Mistral / Mixtral, Qwen3-MoE: ``model.embed_tokens``, ``model.layers.{l}.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm}``, Qwen2's ``self_attn.{q,k,v}_proj.bias`` (our bq/bk/bv,
  flattened head-major), Qwen3's ``self_attn.{q,k}_norm`` (our q_norm/k_norm), SwiGLU ``mlp.{gate,up,down}_proj``,
  Mixtral's MoE ``block_sparse_moe.gate`` (the router) and ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate /
  up / down), Qwen3-MoE's ``mlp.gate`` and ``mlp.experts.{e}.{gate,up,down}_proj`` (the layouts of the published
  checkpoints, which transformers 5 fuses on load; its own fused ``experts.gate_up_proj / down_proj`` layout is
  read too), ``model.norm``, ``lm_head``.
- Gemma 2 / Gemma 3: the attention names above (Gemma 3's q/k norms), then ``post_attention_layernorm`` (our
  ``post_attn_norm``: Gemma's sandwich norm, not the FFN's pre-norm), ``pre_feedforward_layernorm`` (our
  ``ffn_norm``), ``mlp.{gate,up,down}_proj`` (GeGLU), ``post_feedforward_layernorm`` (our ``post_ffn_norm``);
  every gain is Gemma's w of (1 + w), stored as is (``norm_unit_offset``).
- Mamba: ``backbone.embeddings``, ``backbone.layers.{l}.norm``, ``mixer.in_proj`` = [W_x; W_z]ᵀ,
  ``mixer.conv1d`` (I, 1, W) from ``conv_w`` (W, I) (both in cross-correlation order: tap k reads position
  t − (W−1) + k, DESIGN §1), ``mixer.x_proj`` = [W_dt; W_B; W_C]ᵀ, ``mixer.dt_proj`` (weight and bias = our
  ``dt_proj``ᵀ and ``dt_bias``), ``mixer.A_log``, ``mixer.D``, ``mixer.out_proj``, ``backbone.norm_f``, ``lm_head``.
"""

from __future__ import annotations

import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.errors import CheckpointError
from mlx_llm.interop.hf_config import GEMMA_ARCHS, MAMBA, MIXTRAL, MOE_ARCHS

PREFIX = {MAMBA: "backbone.", "attn": "model."}
TOP = {MAMBA: ("embeddings.weight", "norm_f.weight"), "attn": ("embed_tokens.weight", "norm.weight")}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed, never learned


def _t(a) -> np.ndarray:
    """(in, out) ↔ nn.Linear's (out, in)."""
    return np.ascontiguousarray(np.asarray(a).T)


def _family(arch: str) -> str:
    return MAMBA if arch == MAMBA else "attn"


# ----- one layer, ours → transformers ------------------------------------------------------------------------
def attn_to_hf(layer: dict, cfg: ModelConfig) -> dict:
    d, hk, gk = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    out = {"input_layernorm.weight": layer["attn_norm"],
           "self_attn.q_proj.weight": _t(np.reshape(layer["wq"], (d, hk))),
           "self_attn.k_proj.weight": _t(np.reshape(layer["wk"], (d, gk))),
           "self_attn.v_proj.weight": _t(np.reshape(layer["wv"], (d, gk))),
           "self_attn.o_proj.weight": _t(np.reshape(layer["wo"], (hk, d)))}
    if cfg.qkv_bias:
        out |= {f"self_attn.{n}_proj.bias": np.reshape(layer[f"b{n}"], (-1,)) for n in "qkv"}
    if cfg.qk_norm:
        out |= {"self_attn.q_norm.weight": layer["q_norm"], "self_attn.k_norm.weight": layer["k_norm"]}
    return out


def swiglu_to_hf(layer: dict) -> dict:
    return {"post_attention_layernorm.weight": layer["ffn_norm"], "mlp.gate_proj.weight": _t(layer["w_gate"]),
            "mlp.up_proj.weight": _t(layer["w_up"]), "mlp.down_proj.weight": _t(layer["w_down"])}


def gemma_ffn_to_hf(layer: dict) -> dict:
    return {"post_attention_layernorm.weight": layer["post_attn_norm"],
            "pre_feedforward_layernorm.weight": layer["ffn_norm"],
            "post_feedforward_layernorm.weight": layer["post_ffn_norm"], "mlp.gate_proj.weight": _t(layer["w_gate"]),
            "mlp.up_proj.weight": _t(layer["w_up"]), "mlp.down_proj.weight": _t(layer["w_down"])}


# The published per-expert names: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down_proj.
MOE_NAMES = {MIXTRAL: ("block_sparse_moe.", ("w1", "w3", "w2")), "qwen3_moe": ("mlp.", ("gate_proj", "up_proj",
                                                                                         "down_proj"))}


def moe_to_hf(layer: dict, cfg: ModelConfig, arch: str = MIXTRAL) -> dict:
    moe, (gate, up, down) = MOE_NAMES[arch]
    out = {"post_attention_layernorm.weight": layer["ffn_norm"], f"{moe}gate.weight": _t(layer["router"])}
    for e in range(cfg.n_experts):
        out |= {f"{moe}experts.{e}.{gate}.weight": _t(layer["expert_gate"][e]),
                f"{moe}experts.{e}.{up}.weight": _t(layer["expert_up"][e]),
                f"{moe}experts.{e}.{down}.weight": _t(layer["expert_down"][e])}
    return out


def mamba_to_hf(layer: dict) -> dict:
    return {"norm.weight": layer["ssm_norm"],
            "mixer.in_proj.weight": np.concatenate([_t(layer["in_x"]), _t(layer["in_z"])], axis=0),
            "mixer.conv1d.weight": _t(layer["conv_w"])[:, None, :],
            "mixer.conv1d.bias": layer["conv_b"],
            "mixer.x_proj.weight": np.concatenate([_t(layer["w_dt"]), _t(layer["w_B"]), _t(layer["w_C"])], axis=0),
            "mixer.dt_proj.weight": _t(layer["dt_proj"]), "mixer.dt_proj.bias": layer["dt_bias"],
            "mixer.A_log": layer["A_log"], "mixer.D": layer["D"], "mixer.out_proj.weight": _t(layer["out_proj"])}


def layer_to_hf(layer: dict, cfg: ModelConfig, arch: str) -> dict:
    if arch == MAMBA:
        return mamba_to_hf(layer)
    if arch in GEMMA_ARCHS:
        return {**attn_to_hf(layer, cfg), **gemma_ffn_to_hf(layer)}
    ffn = moe_to_hf(layer, cfg, arch) if arch in MOE_ARCHS else swiglu_to_hf(layer)
    return {**attn_to_hf(layer, cfg), **ffn}


def _layers(params: dict, cfg: ModelConfig) -> list[dict]:
    """Each layer's arrays (numpy) from the stacked blocks: one dict over L, or P dicts over L/P."""
    groups = [params["blocks"]] if cfg.uniform else params["blocks"]
    groups = [{k: np.asarray(v) for k, v in g.items()} for g in groups]
    return [{k: v[l // cfg.period] for k, v in groups[l % cfg.period].items()} for l in range(cfg.n_layers)]


def _stack(layers: list[dict], cfg: ModelConfig):
    """The inverse of ``_layers``: ``blocks`` as the layout stacks it."""
    groups = [{k: np.stack([layer[k] for layer in layers[j::cfg.period]]) for k in layers[j]}
              for j in range(cfg.period)]
    return groups[0] if cfg.uniform else groups


def to_hf(params: dict, cfg: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    """Every tensor of the transformers checkpoint of ``params``."""
    fam = _family(arch)
    embed_name, norm_name = TOP[fam]
    out = {PREFIX[fam] + embed_name: params["embed"], PREFIX[fam] + norm_name: params["final_norm"]}
    for l, layer in enumerate(_layers(params, cfg)):
        out |= {f"{PREFIX[fam]}layers.{l}.{k}": v for k, v in layer_to_hf(layer, cfg, arch).items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _t(params["unembed"])
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


# ----- transformers → ours -----------------------------------------------------------------------------------
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})  # what import reads (as float32)


class Reader:
    """Takes tensors by name, checking shapes, and remembers what was taken (leftovers are refused)."""

    def __init__(self, tensors: dict, source: str, dtype=np.float32):
        self.tensors, self.source, self.dtype, self.taken = tensors, source, dtype, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple) -> np.ndarray:
        """The tensor ``name`` of ``shape`` as float32: only the floating dtypes of ``FLOAT_DTYPES`` are read (a
        float32 copy, exact but for float64's rounding), and every value must be finite, in the file and as float32
        (float64 beyond float32's range does not fit); anything else is refused by name."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.source}: tensor {name!r} is missing (expected shape {shape})")
        value = self.tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{self.source}: tensor {name!r} has shape {tuple(value.shape)}, the config "
                                  f"implies {tuple(shape)}")
        if np.dtype(value.dtype).name not in FLOAT_DTYPES:
            raise CheckpointError(f"{self.source}: tensor {name!r} is {np.dtype(value.dtype).name}, not a floating "
                                  f"type: weights are read from {sorted(FLOAT_DTYPES)} only (quantized or integer "
                                  f"checkpoints are not imported)")
        with np.errstate(over="ignore"):  # an overflow is found (and refused) just below
            out = np.asarray(value).astype(self.dtype, copy=False)
        if np.count_nonzero(np.isfinite(out)) != np.size(out):
            self._refuse_non_finite(name, np.asarray(value))
        self.taken.add(name)
        return out

    def _refuse_non_finite(self, name: str, value: np.ndarray):
        """The refusal of a tensor that is not finite as read: NaN or ±inf in the file (damaged), or finite values
        (float64's) beyond the range of the dtype import reads weights as (they do not fit it)."""
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        if bad:
            raise CheckpointError(f"{self.source}: tensor {name!r} holds {bad:,} non-finite value(s) (NaN or ±inf): "
                                  f"the checkpoint is damaged; nothing was imported")
        dtype = np.dtype(self.dtype)
        raise CheckpointError(f"{self.source}: tensor {name!r} ({value.dtype.name}) holds values up to |x| = "
                              f"{float(np.max(np.abs(value))):.4g}, which do not fit {dtype.name} (the dtype import "
                              f"reads weights as; its largest is {float(np.finfo(dtype).max):.4g}): nothing was "
                              f"imported")

    def linear(self, name: str, d_in: int, d_out: int) -> np.ndarray:
        """nn.Linear weight (out, in) → our (in, out)."""
        return _t(self.take(name, (d_out, d_in)))

    def leftovers(self) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.taken and not k.endswith(IGNORED_SUFFIXES))


def attn_from_hf(r: Reader, p: str, cfg: ModelConfig) -> dict:
    d, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    out = {"attn_norm": r.take(p + "input_layernorm.weight", (d,)),
           "wq": r.linear(p + "self_attn.q_proj.weight", d, H * K).reshape(d, H, K),
           "wk": r.linear(p + "self_attn.k_proj.weight", d, G * K).reshape(d, G, K),
           "wv": r.linear(p + "self_attn.v_proj.weight", d, G * K).reshape(d, G, K),
           "wo": r.linear(p + "self_attn.o_proj.weight", H * K, d).reshape(H, K, d)}
    if cfg.qkv_bias:
        out |= {f"b{n}": r.take(f"{p}self_attn.{n}_proj.bias", (heads * K,)).reshape(heads, K)
                for n, heads in (("q", H), ("k", G), ("v", G))}
    if cfg.qk_norm:
        out |= {f"{n}_norm": r.take(f"{p}self_attn.{n}_norm.weight", (K,)) for n in "qk"}
    return out


def swiglu_from_hf(r: Reader, p: str, cfg: ModelConfig) -> dict:
    d, m = cfg.d_model, cfg.d_ff
    return {"ffn_norm": r.take(p + "post_attention_layernorm.weight", (d,)),
            "w_gate": r.linear(p + "mlp.gate_proj.weight", d, m), "w_up": r.linear(p + "mlp.up_proj.weight", d, m),
            "w_down": r.linear(p + "mlp.down_proj.weight", m, d)}


def gemma_ffn_from_hf(r: Reader, p: str, cfg: ModelConfig) -> dict:
    d, m = cfg.d_model, cfg.d_ff
    return {"post_attn_norm": r.take(p + "post_attention_layernorm.weight", (d,)),
            "ffn_norm": r.take(p + "pre_feedforward_layernorm.weight", (d,)),
            "post_ffn_norm": r.take(p + "post_feedforward_layernorm.weight", (d,)),
            "w_gate": r.linear(p + "mlp.gate_proj.weight", d, m), "w_up": r.linear(p + "mlp.up_proj.weight", d, m),
            "w_down": r.linear(p + "mlp.down_proj.weight", m, d)}


def moe_from_hf(r: Reader, p: str, cfg: ModelConfig, arch: str = MIXTRAL) -> dict:
    d, X, m = cfg.d_model, cfg.n_experts, cfg.moe_d_ff
    moe = p + ("block_sparse_moe." if r.has(p + "block_sparse_moe.gate.weight") else "mlp.")
    router = r.linear(moe + "gate.weight", d, X)
    names = MOE_NAMES[arch][1]
    if r.has(moe + "experts.gate_up_proj"):  # transformers 5's own fused layout
        gate_up = r.take(moe + "experts.gate_up_proj", (X, 2 * m, d))
        gate, up = np.swapaxes(gate_up[:, :m], 1, 2), np.swapaxes(gate_up[:, m:], 1, 2)
        down = np.swapaxes(r.take(moe + "experts.down_proj", (X, d, m)), 1, 2)
    else:
        gate, up = (np.stack([r.linear(f"{moe}experts.{e}.{n}.weight", d, m) for e in range(X)]) for n in names[:2])
        down = np.stack([r.linear(f"{moe}experts.{e}.{names[2]}.weight", m, d) for e in range(X)])
    return {"ffn_norm": r.take(p + "post_attention_layernorm.weight", (d,)), "router": router,
            "router_offset": np.zeros((X,), router.dtype),  # Mixtral routes without offsets
            "expert_gate": np.ascontiguousarray(gate), "expert_up": np.ascontiguousarray(up),
            "expert_down": np.ascontiguousarray(down)}


def mamba_from_hf(r: Reader, p: str, cfg: ModelConfig) -> dict:
    d, N, W, R, I = cfg.d_model, cfg.ssm_state, cfg.ssm_conv, cfg.ssm_dt_rank, cfg.ssm_expand * cfg.d_model
    in_proj = r.linear(p + "mixer.in_proj.weight", d, 2 * I)
    x_proj = r.linear(p + "mixer.x_proj.weight", I, R + 2 * N)
    conv_b = (r.take(p + "mixer.conv1d.bias", (I,)) if r.has(p + "mixer.conv1d.bias")
              else np.zeros((I,), r.dtype))  # use_conv_bias = false: a zero bias is the same conv
    return {"ssm_norm": r.take(p + "norm.weight", (d,)),
            "in_x": np.ascontiguousarray(in_proj[:, :I]), "in_z": np.ascontiguousarray(in_proj[:, I:]),
            "conv_w": _t(r.take(p + "mixer.conv1d.weight", (I, 1, W))[:, 0, :]), "conv_b": conv_b,
            "w_dt": np.ascontiguousarray(x_proj[:, :R]), "w_B": np.ascontiguousarray(x_proj[:, R:R + N]),
            "w_C": np.ascontiguousarray(x_proj[:, R + N:]),
            "dt_proj": r.linear(p + "mixer.dt_proj.weight", R, I), "dt_bias": r.take(p + "mixer.dt_proj.bias", (I,)),
            "A_log": r.take(p + "mixer.A_log", (I, N)), "D": r.take(p + "mixer.D", (I,)),
            "out_proj": r.linear(p + "mixer.out_proj.weight", I, d)}


def layer_from_hf(r: Reader, p: str, cfg: ModelConfig, arch: str) -> dict:
    if arch == MAMBA:
        return mamba_from_hf(r, p, cfg)
    if arch in GEMMA_ARCHS:
        return {**attn_from_hf(r, p, cfg), **gemma_ffn_from_hf(r, p, cfg)}
    ffn = moe_from_hf(r, p, cfg, arch) if arch in MOE_ARCHS else swiglu_from_hf(r, p, cfg)
    return {**attn_from_hf(r, p, cfg), **ffn}


def from_hf(tensors: dict, cfg: ModelConfig, arch: str, source: str) -> dict:
    """Our parameter pytree (float32 numpy arrays, ``blocks`` stacked as the layout says) from a transformers
    checkpoint; missing, misshapen or unexpected tensors are refused by name."""
    fam = _family(arch)
    r = Reader(tensors, source)
    embed_name, norm_name = TOP[fam]
    V, d = cfg.vocab_size, cfg.d_model
    layers = [layer_from_hf(r, f"{PREFIX[fam]}layers.{l}.", cfg, arch) for l in range(cfg.n_layers)]
    params = {"embed": r.take(PREFIX[fam] + embed_name, (V, d)),
              "blocks": _stack(layers, cfg),
              "final_norm": r.take(PREFIX[fam] + norm_name, (d,))}
    if not cfg.tie_embeddings:
        params["unembed"] = r.linear("lm_head.weight", d, V)
    elif r.has("lm_head.weight"):
        r.take("lm_head.weight", (V, d))  # a tied checkpoint may store the shared table twice; transformers ties
    extra = r.leftovers()
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} tensor(s) the {arch} layout does not have, e.g. "
                              f"{extra[:3]}: the checkpoint is not a plain {arch} model (biases, adapters, other "
                              f"heads?) and importing it without them would change what it computes")
    return params
