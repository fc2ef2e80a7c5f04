"""``ModelConfig`` ↔ a transformers ``config.json`` for the three architectures both sides share.

| mlx_llm stack | transformers class |
|---|---|
| ``mixer_pattern ("attn",)``, ``ffn_pattern ("swiglu",)`` | ``LlamaForCausalLM`` |
| ``mixer_pattern ("mamba",)``, ``ffn_pattern ("none",)`` | ``MambaForCausalLM`` |
| ``mixer_pattern ("attn",)``, ``ffn_pattern ("moe",)``, softmax router, no shared experts | ``MixtralForCausalLM`` |

Every ``ModelConfig`` field is in one of four groups per architecture: written as a transformers field
(``MAPPED``); pinned to the one value transformers computes (``PINNED``: anything else is refused by name); unused
by that architecture or without effect on its outputs (``ssm_scan`` is how the recurrence is scheduled,
``offset_rate`` a training rule, ``router_eps`` belongs to the sigmoid router): these ride along in the
``"mlx_llm"`` block of ``config.json`` so an import restores the config exactly. A field this module does not know
(added to ``ModelConfig`` later) is refused unless it holds its default value.
"""

from __future__ import annotations

import dataclasses
import math

from mlx_llm.config import ModelConfig
from mlx_llm.errors import ConfigError

LLAMA, MAMBA, MIXTRAL = "llama", "mamba", "mixtral"
CLASSES = {LLAMA: "LlamaForCausalLM", MAMBA: "MambaForCausalLM", MIXTRAL: "MixtralForCausalLM"}
PATTERNS = {(("attn",), ("swiglu",)): LLAMA, (("mamba",), ("none",)): MAMBA, (("attn",), ("moe",)): MIXTRAL}
_ATTN = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "rope_base", "rope_scale",
         "norm_eps", "tie_embeddings", "max_seq_len")
MAPPED = {
    LLAMA: _ATTN + ("d_ff",),
    MIXTRAL: _ATTN + ("n_experts", "moe_top_k", "moe_d_ff"),
    MAMBA: ("vocab_size", "d_model", "n_layers", "norm_eps", "tie_embeddings", "ssm_state", "ssm_conv",
            "ssm_expand", "ssm_dt_rank"),
}
PINNED = {
    LLAMA: {"causal": True},
    MIXTRAL: {"causal": True, "router": "softmax", "n_shared_experts": 0},
    MAMBA: {"causal": True},
}
_WHY = {
    "causal": "a bidirectional model (causal = false, a masked-diffusion denoiser) has no transformers causal-LM "
              "class: every class exported to attends to earlier positions only",
    "router": "the sigmoid router (M20 §15: w_e = a_e/(ε + Σ a_j) of sigmoid scores) has no transformers "
              "equivalent: Mixtral weighs the top-k experts by a softmax (router = 'softmax')",
    "n_shared_experts": "shared (always-run) experts have no place in MixtralForCausalLM",
}
# Fields an architecture does not map (unused by it, or without effect on its outputs): carried in config.json's
# "mlx_llm" block (those of ``CARRIED`` outside ``MAPPED[arch]``).
CARRIED = ("d_ff", "rope_base", "rope_scale", "n_heads", "n_kv_heads", "d_head",
           "max_seq_len", "n_experts", "moe_top_k", "moe_d_ff", "router", "router_eps", "offset_rate",
           "n_shared_experts", "ssm_state", "ssm_conv", "ssm_expand", "ssm_dt_rank", "ssm_scan")
KNOWN = set(CARRIED) | {f for fields in MAPPED.values() for f in fields} | {"causal", "mixer_pattern", "ffn_pattern"}
MAMBA_MAX_SEQ_LEN = 2048  # an imported Mamba without our block: transformers' Mamba has no length limit


def architecture(cfg: ModelConfig) -> str:
    """The transformers architecture ``cfg`` maps to, or a ``ConfigError`` naming what has no equivalent."""
    if not cfg.causal:
        raise ConfigError(f"cannot export: {_WHY['causal']}")
    arch = PATTERNS.get((cfg.mixer_pattern, cfg.ffn_pattern))
    if arch is None:
        raise ConfigError(
            f"cannot export mixer_pattern {list(cfg.mixer_pattern)} with ffn_pattern {list(cfg.ffn_pattern)}: "
            f"transformers has no class for this stack (hybrid or mixed stacks have no equivalent); exportable "
            f"are ['attn'] + ['swiglu'] (Llama), ['mamba'] + ['none'] (Mamba), ['attn'] + ['moe'] (Mixtral)")
    for name, value in PINNED[arch].items():
        if getattr(cfg, name) != value:
            raise ConfigError(f"cannot export ModelConfig.{name} = {getattr(cfg, name)!r} as "
                              f"{CLASSES[arch]}: {_WHY[name]}")
    unknown = [f.name for f in dataclasses.fields(cfg)
               if f.name not in KNOWN and getattr(cfg, f.name) != f.default]
    if unknown:
        raise ConfigError(f"cannot export ModelConfig field(s) {unknown} (set to non-default values): the HF "
                          f"export does not know them, so it cannot say that transformers computes the same model")
    if arch != MAMBA:
        _check_attention_exportable(cfg, arch)
    return arch


def _check_attention_exportable(cfg: ModelConfig, arch: str) -> None:
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"cannot export d_model = {cfg.d_model} with n_heads = {cfg.n_heads} as {CLASSES[arch]}: "
                          f"transformers' config requires hidden_size to be a multiple of num_attention_heads "
                          f"(head_dim {cfg.d_head} is stored separately, but the check is made anyway)")
    if cfg.rope_scale != 1.0 and 1.0 / (1.0 / cfg.rope_scale) != cfg.rope_scale:
        raise ConfigError(f"cannot export rope_scale = {cfg.rope_scale!r}: transformers' linear RoPE scaling "
                          f"stores factor = 1/rope_scale, and 1/(1/{cfg.rope_scale!r}) is not exactly "
                          f"{cfg.rope_scale!r} in floating point; use a rope_scale whose reciprocal round-trips "
                          f"(e.g. 0.25, 0.5)")


# ----- export: ModelConfig → config.json ------------------------------------------------------------------
def to_hf(cfg: ModelConfig, arch: str, special_ids: dict[str, int], extras: dict, dtype: str = "float32") -> dict:
    """The transformers config.json of ``cfg`` (``architecture(cfg)`` = ``arch``, tensors of ``dtype``);
    ``special_ids`` holds bos/eos/pad token ids; ``extras`` goes into the ``"mlx_llm"`` block beside the carried
    fields."""
    common = {"architectures": [CLASSES[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "hidden_act": "silu",
              "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype, "use_cache": True,
              **{f"{k}_token_id": v for k, v in special_ids.items()}}
    carried = {name: getattr(cfg, name) for name in CARRIED if name not in MAPPED[arch] + tuple(PINNED[arch])}
    block = {"mlx_llm": {"model_config": carried, **extras}}
    if arch == MAMBA:
        return {**common, **_mamba_fields(cfg), **block}
    attn = {"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "attention_dropout": 0.0,
            "rope_parameters": _rope_parameters(cfg)}
    if arch == LLAMA:
        return {**common, **attn, "intermediate_size": cfg.d_ff, "attention_bias": False, "mlp_bias": False,
                **block}
    return {**common, **attn, "intermediate_size": cfg.moe_d_ff, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.moe_top_k, "sliding_window": None, "router_jitter_noise": 0.0,
            "output_router_logits": False, **block}


def _rope_parameters(cfg: ModelConfig) -> dict:
    """Our rope_scale s turns position p into s·p before rotating (U19 §7); transformers' "linear" RoPE divides
    the frequencies by a factor f, the same angle p·ω/f for f = 1/s."""
    if cfg.rope_scale == 1.0:
        return {"rope_type": "default", "rope_theta": cfg.rope_base}
    return {"rope_type": "linear", "rope_theta": cfg.rope_base, "factor": 1.0 / cfg.rope_scale}


def _mamba_fields(cfg: ModelConfig) -> dict:
    return {"state_size": cfg.ssm_state, "conv_kernel": cfg.ssm_conv, "expand": cfg.ssm_expand,
            "intermediate_size": cfg.ssm_expand * cfg.d_model, "time_step_rank": cfg.ssm_dt_rank,
            "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True,
            "residual_in_fp32": True}


# ----- import: config.json → ModelConfig ------------------------------------------------------------------
def arch_of(hf: dict, source: str) -> str:
    """Which of the three architectures a transformers config.json describes (else a ``ConfigError``)."""
    names = {v: k for k, v in CLASSES.items()}
    archs = [names[a] for a in hf.get("architectures") or [] if a in names]
    if archs:
        return archs[0]
    if hf.get("model_type") in CLASSES and not hf.get("architectures"):
        return hf["model_type"]
    seen = hf.get("architectures") or hf.get("model_type")
    raise ConfigError(f"{source}: architecture {seen!r} has no mlx_llm equivalent; import reads "
                      f"{sorted(CLASSES.values())}")


def mlx_block(hf: dict) -> dict:
    """config.json's "mlx_llm" block ({} when absent or not ours)."""
    block = hf.get("mlx_llm")
    return block if isinstance(block, dict) else {}


def from_hf(hf: dict, arch: str, source: str) -> ModelConfig:
    """The ``ModelConfig`` of a transformers config.json: fields transformers holds come from its keys (class
    defaults where a key is absent); the rest from our ``"mlx_llm"`` block when present, else our defaults."""
    block = mlx_block(hf).get("model_config")
    block = block if isinstance(block, dict) else {}
    mapped = {MAMBA: _mamba_from_hf, LLAMA: _llama_from_hf, MIXTRAL: _mixtral_from_hf}[arch](hf, source)
    pattern = next(p for p, a in PATTERNS.items() if a == arch)
    fixed = {"mixer_pattern": pattern[0], "ffn_pattern": pattern[1], **PINNED[arch]}
    carried = {k: v for k, v in block.items() if k in CARRIED and k not in mapped and k not in fixed}
    if arch == MAMBA:
        carried.setdefault("max_seq_len", MAMBA_MAX_SEQ_LEN)
    try:
        return ModelConfig(**{**carried, **mapped, **fixed})
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{source}: the {CLASSES[arch]} config gives no valid mlx_llm model: {exc}") from None


def _require(hf: dict, source: str, key: str, allowed, default):
    value = hf.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{source}: {key} = {value!r} has no mlx_llm equivalent (mlx_llm computes {key} = "
                          f"{allowed[0]!r})")
    return value


def _common_from_hf(hf: dict, source: str, tie_default: bool) -> dict:
    _require(hf, source, "hidden_act", ["silu", "swish"], "silu")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise ConfigError(f"{source}: {key} is missing")
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "n_layers": hf["num_hidden_layers"],
            "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default))}


def _mamba_from_hf(hf: dict, source: str) -> dict:
    _require(hf, source, "use_bias", [False], False)
    d = hf.get("hidden_size", 0)
    rank = hf.get("time_step_rank", "auto")
    expand = hf.get("expand", 2)
    if int(expand * d) != hf.get("intermediate_size", int(expand * d)) or expand != int(expand):
        raise ConfigError(f"{source}: expand = {expand!r} with intermediate_size = {hf.get('intermediate_size')}: "
                          f"mlx_llm needs an integer expand with intermediate_size = expand·hidden_size")
    return {**_common_from_hf(hf, source, tie_default=True), "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "ssm_state": hf.get("state_size", 16), "ssm_conv": hf.get("conv_kernel", 4), "ssm_expand": int(expand),
            "ssm_dt_rank": math.ceil(d / 16) if rank == "auto" else rank}


def _attention_from_hf(hf: dict, source: str, eps_default: float, theta_default: float,
                       max_len_default: int) -> dict:
    heads = hf.get("num_attention_heads")
    if heads is None:
        raise ConfigError(f"{source}: num_attention_heads is missing")
    base, scale = _rope_from_hf(hf, source, theta_default)
    return {**_common_from_hf(hf, source, tie_default=False), "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads,
            "d_head": hf.get("head_dim") or hf["hidden_size"] // heads, "norm_eps": hf.get("rms_norm_eps", eps_default),
            "rope_base": base, "rope_scale": scale,
            "max_seq_len": hf.get("max_position_embeddings", max_len_default)}


def _rope_from_hf(hf: dict, source: str, theta_default: float) -> tuple[float, float]:
    """(rope_base, rope_scale) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta", theta_default))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 has no mlx_llm equivalent: our RoPE turns every "
                          f"coordinate pair of a head")
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, 1.0 / rope["factor"]
    raise ConfigError(f"{source}: RoPE type {kind!r} has no mlx_llm equivalent; mlx_llm has plain RoPE and "
                      f"position interpolation ('default' and 'linear')")


def _llama_from_hf(hf: dict, source: str) -> dict:
    _require(hf, source, "attention_bias", [False], False)
    _require(hf, source, "mlp_bias", [False], False)
    return {**_attention_from_hf(hf, source, 1e-6, 10000.0, 2048), "d_ff": hf.get("intermediate_size")}


def _mixtral_from_hf(hf: dict, source: str) -> dict:
    attn = _attention_from_hf(hf, source, 1e-5, 1e6, 4096 * 32)
    window = hf.get("sliding_window")
    if window is not None and window < attn["max_seq_len"]:
        raise ConfigError(f"{source}: sliding_window = {window} has no mlx_llm equivalent (our attention reads "
                          f"every earlier position up to max_seq_len = {attn['max_seq_len']})")
    return {**attn, "n_experts": hf.get("num_local_experts", 8), "moe_top_k": hf.get("num_experts_per_tok", 2),
            "moe_d_ff": hf.get("intermediate_size")}
