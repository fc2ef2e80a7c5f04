"""``ModelConfig`` ↔ a transformers ``config.json`` for the architectures both sides share.

| mlx_llm stack | transformers class |
|---|---|
| ``("attn",)`` + ``("swiglu",)`` | ``LlamaForCausalLM`` (with ``rope_scaling`` linear / llama3 / yarn / dynamic) |
| the same with ``qkv_bias`` (windows through ``layer_types``) | ``Qwen2ForCausalLM`` |
| the same with ``qk_norm`` (windows through ``layer_types``) | ``Qwen3ForCausalLM`` |
| ``("local",)`` (every layer windowed) or ``("attn",)`` + ``("swiglu",)`` | ``MistralForCausalLM`` |
| ``("attn",)`` or ``("local",)`` + ``("moe",)``, softmax router, no shared experts | ``MixtralForCausalLM`` |
| the same with ``qk_norm`` (``norm_topk_prob``; windows through ``layer_types``) | ``Qwen3MoeForCausalLM`` |
| ``("mamba",)`` + ``("none",)`` | ``MambaForCausalLM`` |
| ``("attn",)`` / ``("local", "attn")`` … + ``("geglu",)``, sandwich norms, (1 + w) gains, √d embedding scale, soft caps | ``Gemma2ForCausalLM`` |
| the same with ``qk_norm`` and the local layers' RoPE base | ``Gemma3ForCausalLM`` (Gemma 3 text) |

Export picks the class from the config (``architecture``): Mamba; MoE → Qwen3-MoE with ``qk_norm``, else Mixtral;
GeGLU → Gemma 3 with ``qk_norm``, else Gemma 2; SwiGLU → Qwen3 with ``qk_norm``, Qwen2 with ``qkv_bias``, Mistral
when every layer is windowed, else Llama. Gemma's windows are per layer (``layer_types``); its
``query_pre_attn_scalar`` is our ``score_dim`` (unset: d_head), its soft caps ours; Gemma 3's ``rope_parameters``
holds one entry per layer type (ours: ``rope_base`` and its scaling for the global layers, ``rope_local_base`` for
the local ones). Knobs that change no output of a trained model (``zero_init_out``, the window warmup) ride
along; the MTP modules (``mtp_depth``) have no transformers equivalent and are dropped on export
(``interop.hf.export_model`` says so).
Every ``ModelConfig`` field is in one of four groups per architecture: written as a transformers field
(``MAPPED``, with the RoPE scaling in ``rope_parameters`` and windows in ``sliding_window`` / ``layer_types``);
pinned to the one value transformers computes (``PINNED``: anything else is refused by name); unused
by that architecture or without effect on its outputs (``ssm_scan`` is how the recurrence is scheduled,
``offset_rate`` a training rule, ``router_eps`` belongs to the sigmoid router): these ride along in the
``"mlx_llm"`` block of ``config.json`` so an import restores the config exactly. A field this module does not know
(added to ``ModelConfig`` later) is refused unless it holds its default value.
"""

from __future__ import annotations

import dataclasses
import math

from mlx_llm.config import ATTENTION_KINDS, ModelConfig
from mlx_llm.errors import ConfigError

LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, QWEN3_MOE, MAMBA, GEMMA2, GEMMA3 = (
    "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "mamba", "gemma2", "gemma3_text")
CLASSES = {LLAMA: "LlamaForCausalLM", QWEN2: "Qwen2ForCausalLM", QWEN3: "Qwen3ForCausalLM",
           MISTRAL: "MistralForCausalLM", MIXTRAL: "MixtralForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM",
           MAMBA: "MambaForCausalLM", GEMMA2: "Gemma2ForCausalLM", GEMMA3: "Gemma3ForCausalLM"}
MOE_ARCHS = (MIXTRAL, QWEN3_MOE)
GEMMA_ARCHS = (GEMMA2, GEMMA3)
LAYER_TYPES_ARCHS = (QWEN2, QWEN3, QWEN3_MOE) + GEMMA_ARCHS  # windows per layer through ``layer_types``
WINDOW_ALL_ARCHS = (MISTRAL, MIXTRAL)  # one ``sliding_window`` for every layer
_ROPE = ("rope_base", "rope_scale", "rope_scaling", "rope_factor", "rope_original_max_len", "rope_low_freq_factor",
         "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
         "rope_attention_factor", "rope_truncate")
_ATTN = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "norm_eps", "tie_embeddings",
         "max_seq_len", "mixer_pattern", "sliding_window") + _ROPE
_EXPERTS = ("n_experts", "moe_top_k", "moe_d_ff")
_GEMMA = _ATTN + ("d_ff", "attn_softcap", "logit_softcap", "score_dim")
MAPPED = {
    **{arch: _ATTN + ("d_ff",) for arch in (LLAMA, QWEN2, QWEN3, MISTRAL)},
    **{arch: _ATTN + _EXPERTS for arch in MOE_ARCHS},
    MAMBA: ("vocab_size", "d_model", "n_layers", "norm_eps", "tie_embeddings", "ssm_state", "ssm_conv",
            "ssm_expand", "ssm_dt_rank"),
    GEMMA2: _GEMMA, GEMMA3: _GEMMA + ("rope_local_base",),
}
# The knobs of Gemma's computation: off in every other class (a config with one set exports only as Gemma)
_NO_GEMMA = {"sandwich_norm": False, "norm_unit_offset": False, "embed_scale": False, "attn_softcap": None,
             "logit_softcap": None, "score_dim": None, "rope_local_base": None}
_PLAIN = {"causal": True, "qkv_bias": False, "qk_norm": False, **_NO_GEMMA}
_GEMMA_PINNED = {"causal": True, "qkv_bias": False, "sandwich_norm": True, "norm_unit_offset": True,
                 "embed_scale": True}
PINNED = {
    LLAMA: _PLAIN, MISTRAL: _PLAIN, MAMBA: {"causal": True, **_NO_GEMMA},
    QWEN2: {**_PLAIN, "qkv_bias": True}, QWEN3: {**_PLAIN, "qk_norm": True},
    MIXTRAL: {**_PLAIN, "router": "softmax", "n_shared_experts": 0},
    QWEN3_MOE: {**_PLAIN, "qk_norm": True, "router": "softmax", "n_shared_experts": 0},
    GEMMA2: {**_GEMMA_PINNED, "qk_norm": False, "rope_local_base": None}, GEMMA3: {**_GEMMA_PINNED, "qk_norm": True},
}
_WHY = {
    "causal": "a bidirectional model (causal = false, a masked-diffusion denoiser) has no transformers causal-LM "
              "class: every class exported to attends to earlier positions only",
    "router": "the sigmoid router (M20 §15: w_e = a_e/(ε + Σ a_j) of sigmoid scores) has no transformers "
              "equivalent: Mixtral and Qwen3-MoE weigh the top-k experts by a softmax (router = 'softmax')",
    "n_shared_experts": "shared (always-run) experts have no place in MixtralForCausalLM or Qwen3MoeForCausalLM",
    "qkv_bias": "q/k/v biases exist in Qwen2 only (Llama's attention_bias also biases o_proj, and Qwen3 adds "
                "q/k norms)",
    "qk_norm": "q/k RMSNorm exists in Qwen3, Qwen3-MoE and Gemma 3 only (and Gemma 3 always has it)",
    "sandwich_norm": "the norms after each sublayer (sandwich_norm) exist in Gemma 2/3 only, which always have them",
    "norm_unit_offset": "the (1 + w) gains exist in Gemma 2/3 only, which always use them",
    "embed_scale": "the √d embedding scale exists in Gemma 2/3 only, which always apply it",
    "attn_softcap": "attention soft-capping exists in Gemma 2/3 only",
    "logit_softcap": "final-logit soft-capping exists in Gemma 2/3 only",
    "score_dim": "a score scale other than 1/√d_head (query_pre_attn_scalar) exists in Gemma 2/3 only",
    "rope_local_base": "a RoPE base of their own for the local layers exists in Gemma 3 only",
}
# Fields an architecture does not map (unused by it, or without effect on its outputs): carried in config.json's
# "mlx_llm" block (those of ``CARRIED`` outside ``MAPPED[arch]``).
# (the knobs that change no output of a trained model — an initialisation, a training-time window — ride along too)
CARRIED = ("d_ff", "n_heads", "n_kv_heads", "d_head", "max_seq_len", "n_experts", "moe_top_k", "moe_d_ff",
           "router", "router_eps", "offset_rate", "n_shared_experts", "ssm_state", "ssm_conv", "ssm_expand",
           "ssm_dt_rank", "ssm_scan", "sliding_window", "zero_init_out", "window_warmup_steps",
           "window_warmup_start") + _ROPE
KNOWN = (set(CARRIED) | {f for fields in MAPPED.values() for f in fields} | set(_NO_GEMMA)
         | {"causal", "mixer_pattern", "ffn_pattern", "qkv_bias", "qk_norm"}
         | {"vocab_used"})  # a padded vocabulary: the tokenizer's size says it (interop/hf.py), both ways
MAMBA_MAX_SEQ_LEN = 2048  # an imported Mamba without our block: transformers' Mamba has no length limit


def _choose(cfg: ModelConfig) -> str:
    """The class a config exports to (the rule of the module docstring), or a ``ConfigError``."""
    mixers, ffns = set(cfg.mixer_pattern), cfg.ffn_pattern
    if cfg.mixer_pattern == ("mamba",) and ffns == ("none",):
        return MAMBA
    if not mixers <= set(ATTENTION_KINDS) or ffns not in (("swiglu",), ("moe",), ("geglu",)):
        raise ConfigError(
            f"cannot export mixer_pattern {list(cfg.mixer_pattern)} with ffn_pattern {list(ffns)}: transformers "
            f"has no class for this stack (hybrid or mixed stacks have no equivalent); exportable are attention "
            f"('attn'/'local') + ['swiglu'] (Llama, Qwen2, Qwen3, Mistral), + ['moe'] (Mixtral, Qwen3-MoE), "
            f"+ ['geglu'] (Gemma 2, Gemma 3), ['mamba'] + ['none'] (Mamba)")
    if ffns == ("moe",):
        return QWEN3_MOE if cfg.qk_norm else MIXTRAL
    if ffns == ("geglu",):
        return GEMMA3 if cfg.qk_norm else GEMMA2
    if cfg.qk_norm:
        return QWEN3
    if cfg.qkv_bias:
        return QWEN2
    return MISTRAL if mixers == {"local"} else LLAMA


def architecture(cfg: ModelConfig) -> str:
    """The transformers architecture ``cfg`` maps to, or a ``ConfigError`` naming what has no equivalent."""
    if not cfg.causal:
        raise ConfigError(f"cannot export: {_WHY['causal']}")
    arch = _choose(cfg)
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
    if arch in GEMMA_ARCHS and cfg.score_dim is not None and not float(cfg.score_dim).is_integer():
        raise ConfigError(f"cannot export score_dim = {cfg.score_dim!r} as {CLASSES[arch]}: its "
                          f"query_pre_attn_scalar is an integer")
    return arch


def _check_attention_exportable(cfg: ModelConfig, arch: str) -> None:
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"cannot export d_model = {cfg.d_model} with n_heads = {cfg.n_heads} as {CLASSES[arch]}: "
                          f"transformers' config requires hidden_size to be a multiple of num_attention_heads "
                          f"(head_dim {cfg.d_head} is stored separately, but the check is made anyway)")
    if "local" in cfg.mixer_pattern and arch not in LAYER_TYPES_ARCHS + WINDOW_ALL_ARCHS:
        raise ConfigError(f"cannot export mixer_pattern {list(cfg.mixer_pattern)} as {CLASSES[arch]}: it has no "
                          f"sliding window")
    if "local" in cfg.mixer_pattern and "attn" in cfg.mixer_pattern and arch in WINDOW_ALL_ARCHS:
        raise ConfigError(f"cannot export mixer_pattern {list(cfg.mixer_pattern)} as {CLASSES[arch]}: it windows "
                          f"every layer or none (alternating local/global layers export as Qwen2/Qwen3 layer_types)")
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
              **{f"{k}_token_id": v for k, v in special_ids.items() if v is not None}}
    carried = {name: getattr(cfg, name) for name in CARRIED if name not in MAPPED[arch] + tuple(PINNED[arch])}
    if cfg.rope_scaling == "dynamic":  # max_position_embeddings holds T₀ (``_hf_max_positions``)
        carried["max_seq_len"] = cfg.max_seq_len
    block = {"mlx_llm": {"model_config": carried, **extras}}
    if arch == MAMBA:
        return {**common, **_mamba_fields(cfg), **block}
    attn = {"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
            "max_position_embeddings": _hf_max_positions(cfg), "rms_norm_eps": cfg.norm_eps,
            "attention_dropout": 0.0, "rope_parameters": _rope_parameters(cfg), **_window_fields(cfg, arch)}
    if arch in GEMMA_ARCHS:
        common.pop("hidden_act")
        return {**common, **attn, **_gemma_fields(cfg, arch), **block}
    if arch in MOE_ARCHS:
        ffn = {"num_experts_per_tok": cfg.moe_top_k, "router_jitter_noise": 0.0, "output_router_logits": False}
        if arch == MIXTRAL:
            ffn |= {"intermediate_size": cfg.moe_d_ff, "num_local_experts": cfg.n_experts}
        else:
            ffn |= {"moe_intermediate_size": cfg.moe_d_ff, "num_experts": cfg.n_experts, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": cfg.moe_d_ff,
                    "attention_bias": False}
        return {**common, **attn, **ffn, **block}
    bias = {"attention_bias": False} if arch in (LLAMA, QWEN3) else {}
    return {**common, **attn, "intermediate_size": cfg.d_ff, **bias, **({"mlp_bias": False} if arch == LLAMA else {}),
            **block}


def _gemma_fields(cfg: ModelConfig, arch: str) -> dict:
    """Gemma 2/3's own keys: the GeGLU width and activation, query_pre_attn_scalar, the soft caps, and Gemma 3's
    RoPE per layer type (the local layers at ``rope_local_base``, else as the global ones)."""
    out = {"intermediate_size": cfg.d_ff, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
           "query_pre_attn_scalar": int(cfg.score_dim or cfg.d_head), "attn_logit_softcapping": cfg.attn_softcap,
           "final_logit_softcapping": cfg.logit_softcap, "use_bidirectional_attention": False}
    if arch == GEMMA3:
        full = _rope_parameters(cfg)
        local = full if cfg.rope_local_base is None else {"rope_type": "default", "rope_theta": cfg.rope_local_base}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


def _hf_max_positions(cfg: ModelConfig) -> int:
    """``max_position_embeddings``: our max_seq_len, except under dynamic NTK, where transformers reads it as the
    context T₀ beyond which the base grows (our max_seq_len then rides in the "mlx_llm" block)."""
    return cfg.rope_original_len if cfg.rope_scaling == "dynamic" else cfg.max_seq_len


def _window_fields(cfg: ModelConfig, arch: str) -> dict:
    local = "local" in cfg.mixer_pattern
    if arch in WINDOW_ALL_ARCHS:
        return {"sliding_window": cfg.sliding_window if local else None}
    if arch == LLAMA:
        return {}
    kinds = [cfg.layer_kinds(l)[0] for l in range(cfg.n_layers)]
    types = ["sliding_attention" if k == "local" else "full_attention" for k in kinds]
    if arch in GEMMA_ARCHS:
        return {"sliding_window": cfg.sliding_window if local else None, "layer_types": types}
    return {"use_sliding_window": local, "sliding_window": cfg.sliding_window if local else None,
            "max_window_layers": 0 if local else cfg.n_layers,
            "layer_types": ["sliding_attention" if k == "local" else "full_attention" for k in kinds]}


def _rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of our RoPE scaling (layers/rope_scaling.py). Our rope_scale s turns
    position p into s·p (U19 §7); transformers' "linear" divides the frequencies by f = 1/s: the same angle."""
    base = {"rope_theta": cfg.rope_base}
    kind = cfg.rope_scaling
    if kind == "none":
        return {"rope_type": "default", **base}
    if kind == "linear":
        return {"rope_type": "linear", **base, "factor": 1.0 / cfg.rope_scale}
    if kind == "dynamic":
        return {"rope_type": "dynamic", **base, "factor": cfg.rope_factor}
    original = {"original_max_position_embeddings": cfg.rope_original_len}
    if kind == "llama3":
        return {"rope_type": "llama3", **base, "factor": cfg.rope_factor, **original,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor}
    out = {"rope_type": "yarn", **base, "factor": cfg.rope_factor, **original, "beta_fast": cfg.rope_beta_fast,
           "beta_slow": cfg.rope_beta_slow, "truncate": cfg.rope_truncate}
    optional = {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
                "attention_factor": cfg.rope_attention_factor}
    return {**out, **{k: v for k, v in optional.items() if v is not None}}


def _mamba_fields(cfg: ModelConfig) -> dict:
    return {"state_size": cfg.ssm_state, "conv_kernel": cfg.ssm_conv, "expand": cfg.ssm_expand,
            "intermediate_size": cfg.ssm_expand * cfg.d_model, "time_step_rank": cfg.ssm_dt_rank,
            "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True,
            "residual_in_fp32": True}


# ----- import: config.json → ModelConfig ------------------------------------------------------------------
def arch_of(hf: dict, source: str) -> str:
    """Which of the architectures a transformers config.json describes (else a ``ConfigError``)."""
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
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConfigError(f"{source}: {key} = {hf[key]!r} is invalid: it must be an object (e.g. "
                              f'{{"rope_type": "linear", "factor": 2.0}}) or null')
    try:
        mapped = _mamba_from_hf(hf, source) if arch == MAMBA else _attention_arch_from_hf(hf, arch, source)
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{source}: a field of the {CLASSES[arch]} config has a value of the wrong kind or range "
                          f"({type(exc).__name__}: {exc})") from None
    ffn = {MAMBA: ("none",), **{a: ("moe",) for a in MOE_ARCHS}, **{a: ("geglu",) for a in GEMMA_ARCHS}}.get(
        arch, ("swiglu",))
    fixed = {"ffn_pattern": ffn, **PINNED[arch], **({"mixer_pattern": ("mamba",)} if arch == MAMBA else {})}
    carried = {k: v for k, v in block.items() if k in CARRIED and k not in mapped and k not in fixed}
    if arch == MAMBA:
        carried.setdefault("max_seq_len", MAMBA_MAX_SEQ_LEN)
    if mapped.get("rope_scaling") == "dynamic" and "max_seq_len" in block:
        mapped["max_seq_len"] = block["max_seq_len"]  # max_position_embeddings was T₀ (``_hf_max_positions``)
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


def _common_from_hf(hf: dict, source: str, tie_default: bool, act: tuple = ("hidden_act", ["silu", "swish"])) -> dict:
    _require(hf, source, act[0], act[1], act[1][0])
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise ConfigError(f"{source}: {key} is missing")
    tie = hf.get("tie_word_embeddings", tie_default)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings = {tie!r} must be true or false")
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "n_layers": hf["num_hidden_layers"],
            "tie_embeddings": tie}


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


# transformers' class defaults for the keys a config.json may leave out: (rms_norm_eps, rope_theta, max positions)
_DEFAULTS = {LLAMA: (1e-6, 10000.0, 2048), QWEN2: (1e-6, 10000.0, 32768), QWEN3: (1e-6, 10000.0, 32768),
             MISTRAL: (1e-6, 10000.0, 4096 * 32), MIXTRAL: (1e-5, 1e6, 4096 * 32), QWEN3_MOE: (1e-6, 10000.0, 32768),
             GEMMA2: (1e-6, 10000.0, 8192), GEMMA3: (1e-6, 1e6, 131072)}
# Gemma's class defaults: (attn_logit_softcapping, final_logit_softcapping), Gemma 3's local RoPE base
_GEMMA_CAPS = {GEMMA2: (50.0, 30.0), GEMMA3: (None, None)}
GEMMA3_LOCAL_BASE = 10000.0


def _attention_arch_from_hf(hf: dict, arch: str, source: str) -> dict:
    """The mapped fields of an attention architecture: heads, RoPE, windows, then the FFN's."""
    if arch == LLAMA:
        _require(hf, source, "attention_bias", [False], False)
        _require(hf, source, "mlp_bias", [False], False)
    if arch in (QWEN3, QWEN3_MOE) + GEMMA_ARCHS:
        _require(hf, source, "attention_bias", [False], False)
    eps, theta, max_len = _DEFAULTS[arch]
    heads = _positive_int(hf, source, "num_attention_heads")
    if heads is None:
        raise ConfigError(f"{source}: num_attention_heads is missing")
    gemma = arch in GEMMA_ARCHS
    act = ("hidden_activation", ["gelu_pytorch_tanh"]) if gemma else ("hidden_act", ["silu", "swish"])
    rope = _gemma3_rope_from_hf(hf, source) if arch == GEMMA3 else _rope_from_hf(hf, source, theta)
    kv_heads, head_dim = (_positive_int(hf, source, key) for key in ("num_key_value_heads", "head_dim"))
    out = {**_common_from_hf(hf, source, tie_default=gemma, act=act), "n_heads": heads,
           "n_kv_heads": heads if kv_heads is None else kv_heads,
           "d_head": hf["hidden_size"] // heads if head_dim is None else head_dim,
           "norm_eps": hf.get("rms_norm_eps", eps), "max_seq_len": hf.get("max_position_embeddings", max_len), **rope}
    out |= _windows_from_hf(hf, arch, source, out["n_layers"], out["max_seq_len"])
    if gemma:
        _require(hf, source, "use_bidirectional_attention", [False, None], False)
        qpas = _score_dim(hf, source)
        caps = {k: hf.get(k, default) for k, default in zip(("attn_logit_softcapping", "final_logit_softcapping"),
                                                           _GEMMA_CAPS[arch])}
        return {**out, "d_ff": hf.get("intermediate_size"), "score_dim": None if qpas == out["d_head"] else qpas,
                "attn_softcap": caps["attn_logit_softcapping"], "logit_softcap": caps["final_logit_softcapping"]}
    if arch == MIXTRAL:
        return {**out, "n_experts": hf.get("num_local_experts", 8), "moe_top_k": hf.get("num_experts_per_tok", 2),
                "moe_d_ff": hf.get("intermediate_size")}
    if arch == QWEN3_MOE:
        _require(hf, source, "norm_topk_prob", [True], False)
        _require(hf, source, "decoder_sparse_step", [1], 1)
        _require(hf, source, "mlp_only_layers", [[]], [])
        experts = hf.get("num_experts", hf.get("num_local_experts", 128))  # transformers saves the latter
        return {**out, "n_experts": experts, "moe_top_k": hf.get("num_experts_per_tok", 8),
                "moe_d_ff": hf.get("moe_intermediate_size", 768)}
    return {**out, "d_ff": hf.get("intermediate_size")}


def _positive_int(hf: dict, source: str, key: str) -> int | None:
    """``hf[key]`` when it is a positive integer, None when absent or null (the class default applies); anything
    else (0 included, which a fallback would silently replace) is refused naming the key."""
    value = hf.get(key)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ConfigError(f"{source}: {key} = {value!r} is invalid: it must be a positive integer (or absent)")
    return value


MAX_SCORE_DIM = 1 << 24  # the integers float32 holds exactly


def _score_dim(hf: dict, source: str) -> int:
    """Gemma's ``query_pre_attn_scalar`` s (scores scaled by 1/√s; the class default 256): an integer in
    [1, 2²⁴], the range in which float32 holds every integer exactly. Gemma's own are the head width or
    d_model / heads (256, 144, 168); a value such as 1e30 is no trained model's and would scale every score to
    almost nothing (uniform attention)."""
    value = hf.get("query_pre_attn_scalar", 256)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and float(value).is_integer() and 1 <= value <= MAX_SCORE_DIM):
        raise ConfigError(f"{source}: query_pre_attn_scalar = {value!r} is invalid: it must be an integer from 1 to "
                          f"{MAX_SCORE_DIM:,} (Gemma's is the head width or hidden_size / num_attention_heads, "
                          f"e.g. 256 or 144)")
    return int(value)


def _rope_from_hf(hf: dict, source: str, theta_default: float) -> dict:
    """Our RoPE fields from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_base": rope.get("rope_theta", hf.get("rope_theta", theta_default))}
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 has no mlx_llm equivalent: our RoPE turns every "
                          f"coordinate pair of a head")
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ConfigError(f"{source}: RoPE type {kind!r} has no mlx_llm equivalent; mlx_llm has 'default', "
                          f"'linear', 'llama3', 'yarn' and 'dynamic'")
    if kind == "default":
        return out
    if rope.get("factor") is None and kind != "yarn":
        raise ConfigError(f"{source}: RoPE type {kind!r} needs a factor in rope_parameters")
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scale": 1.0 / rope["factor"]}
    if kind == "dynamic":  # transformers grows the base beyond max_position_embeddings
        return {**out, "rope_scaling": "dynamic", "rope_factor": rope["factor"],
                "rope_original_max_len": hf.get("max_position_embeddings")}
    original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    out |= {"rope_scaling": kind, "rope_original_max_len": original}
    if kind == "llama3":
        return {**out, "rope_factor": rope["factor"], "rope_low_freq_factor": rope.get("low_freq_factor", 1.0),
                "rope_high_freq_factor": rope.get("high_freq_factor", 4.0)}
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    return {**out, "rope_factor": factor, "rope_beta_fast": rope.get("beta_fast") or 32.0,
            "rope_beta_slow": rope.get("beta_slow") or 1.0, "rope_mscale": rope.get("mscale"),
            "rope_mscale_all_dim": rope.get("mscale_all_dim"), "rope_attention_factor": rope.get("attention_factor"),
            "rope_truncate": rope.get("truncate", True)}


def _gemma3_rope_from_hf(hf: dict, source: str) -> dict:
    """Gemma 3's RoPE: ``rope_parameters`` per layer type (transformers 5) or the older ``rope_theta``,
    ``rope_scaling`` and ``rope_local_base_freq``. The global layers' entry gives ours; the local layers' is ours
    too (``rope_local_base`` unset) or plain RoPE at a base of its own (``rope_local_base``)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_type": "default"}
        local = params.get("sliding_attention") or {"rope_type": "default"}
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", _DEFAULTS[GEMMA3][1])}
        full.setdefault("rope_type", full.pop("type", "default"))
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", GEMMA3_LOCAL_BASE)}
    full = {**full, "rope_theta": full.get("rope_theta", _DEFAULTS[GEMMA3][1])}
    local = {**local, "rope_theta": local.get("rope_theta", GEMMA3_LOCAL_BASE)}
    out = _rope_from_hf({**hf, "rope_parameters": full}, source, _DEFAULTS[GEMMA3][1])
    if local == full:
        return out
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise ConfigError(f"{source}: the sliding_attention layers' RoPE {local!r} has no mlx_llm equivalent: local "
                          f"layers rotate like the global ones or plainly at a base of their own")
    return {**out, "rope_local_base": local["rope_theta"]}


def _windows_from_hf(hf: dict, arch: str, source: str, n_layers: int, max_len: int) -> dict:
    """``mixer_pattern`` and ``sliding_window`` from ``sliding_window`` (Mistral, Mixtral: every layer) or
    ``layer_types`` (Qwen2/3: per layer; computed from use_sliding_window / max_window_layers when absent)."""
    window = hf.get("sliding_window")
    if arch == LLAMA:
        return {"mixer_pattern": ("attn",)}
    if arch in WINDOW_ALL_ARCHS:
        local = window is not None and window < max_len
        return {"mixer_pattern": ("local",), "sliding_window": window} if local else {"mixer_pattern": ("attn",)}
    if arch in GEMMA_ARCHS:  # Gemma 2 alternates from a local layer 0; Gemma 3 has 5 local to 1 global
        every = 2 if arch == GEMMA2 else hf.get("sliding_window_pattern", 6)
        types = hf.get("layer_types")
        if types is None:  # absent or null: the class default (an empty list is not absent, and is refused)
            types = ["sliding_attention" if (l + 1) % every else "full_attention" for l in range(n_layers)]
    else:
        types = hf.get("layer_types")
        window = window if hf.get("use_sliding_window", False) or types is not None else None
        if types is None:
            types = ["sliding_attention" if window is not None and l >= hf.get("max_window_layers", n_layers)
                     else "full_attention" for l in range(n_layers)]
    known = {"full_attention": "attn", "sliding_attention": "local"}
    if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
        raise ConfigError(f"{source}: layer_types {types!r} is invalid: one of {sorted(known)} per layer "
                          f"({n_layers} layers)")
    kinds = [known[t] for t in types]
    if "local" in kinds and window is None:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
    # the shortest repeating unit (any list is one: e.g. Qwen's full attention below max_window_layers)
    period = next(p for p in range(1, n_layers + 1) if n_layers % p == 0 and kinds == kinds[:p] * (n_layers // p))
    out = {"mixer_pattern": tuple(kinds[:period])}
    return {**out, "sliding_window": window} if "local" in kinds else out
