"""Model configuration: one frozen, hashable dataclass, JSON round trip, validation, parameter count.

``ModelConfig`` is a static argument of every jitted function, so it must be hashable and immutable.
Validation runs in ``__post_init__``: an invalid config cannot exist.
"""

from __future__ import annotations

import dataclasses
import math

from mlx_llm.errors import ConfigError
from mlx_llm.kernels import ATTENTION_IMPLS, MOE_IMPLS, SSM_SCANS, Kernels
from mlx_llm.settings import JsonConfig, check_int, check_number, setting, umask_mode, write_json_atomic  # noqa: F401
from mlx_llm.layers import layout  # the parameter layout the counts below sum (it imports no mlx_llm module)

_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "max_seq_len")

# Sublayer kinds (DESIGN §1, "Variants") and the fields each one needs.
MIXER_KINDS = ("attn", "local", "mamba")  # "local": sliding-window attention over the last sliding_window positions
ATTENTION_KINDS = ("attn", "local")  # the mixer kinds that are attention (same keys, layers/attention.py)
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "dynamic")  # ModelConfig.rope_scaling (layers/rope_scaling.py)
FFN_KINDS = ("swiglu", "geglu", "relu2", "moe", "none")
ROUTERS = ("sigmoid", "softmax")
OBJECTIVES = ("ar", "diffusion")  # TrainConfig.objective
MESH_AXES = ("data", "fsdp", "tensor")  # TrainConfig.mesh (train/parallel.py)
REMAT_POLICIES = ("none", "full", "dots")  # TrainConfig.remat (model.run_stack)
MUP_MIXERS, MUP_FFNS = ("attn", "local"), ("swiglu", "none")  # the layer kinds μP's rules cover (layers/layout.py)
_NEEDS = {"attn": ("n_heads", "n_kv_heads", "d_head"), "local": ("n_heads", "n_kv_heads", "d_head", "sliding_window"),
          "mamba": (), "swiglu": ("d_ff",), "geglu": ("d_ff",), "relu2": ("d_ff",),
          "moe": ("n_experts", "moe_top_k", "moe_d_ff"), "none": ()}


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=4"`` → {"data": 2, "fsdp": 4} (axes of ``MESH_AXES``, sizes ≥ 1 or one -1); "" → {}."""
    if not isinstance(spec, str):
        raise ConfigError(f"mesh = {spec!r} is invalid: give it as a string such as 'data=2,fsdp=4'")
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or name in sizes or not size.strip().lstrip("-").isdigit():
            raise ConfigError(f"mesh {spec!r}: {part!r} is invalid: each entry is AXIS=SIZE with AXIS one of "
                              f"{list(MESH_AXES)} (each at most once), e.g. 'data=2,fsdp=4'")
        sizes[name] = int(size)
        if sizes[name] < 1 and sizes[name] != -1:
            raise ConfigError(f"mesh {spec!r}: {name} = {sizes[name]} is invalid: a size is >= 1, or -1 for "
                              f"whatever the other axes leave")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"mesh {spec!r}: at most one axis may be -1")
    return sizes


INT32_MAX = 2**31 - 1  # token ids, positions and the step counter are int32
SEED_MAX = 2**63 - 1  # seeds are int64 (JSON, numpy's generators); ops.seed_key gives each its own key
SOFTCAP_MIN = 1.0  # a soft cap c keeps values in (−c, c): below 1 no two tokens' odds can differ by e² (ModelConfig)
MUP_WIDER_MAX = 16  # a μP base model at most this many times wider than the model (m = d / d₀ ≥ 1/16)


def _require_int(cfg, name: str, *, minimum: int, maximum: int = INT32_MAX) -> None:
    bound = f"a positive integer ≤ {maximum:,}" if minimum == 1 else f"an integer >= {minimum} and ≤ {maximum:,}"
    check_int(f"{type(cfg).__name__}.{name}", getattr(cfg, name), minimum, maximum=maximum,
              reason=f"it must be {bound}")


def _require_float(cfg, name: str, *, positive: bool = False, low: float | None = None,
                   high: float | None = None) -> None:
    """Finite number (optionally > 0, or in [low, high]); ints are normalised to float so equal configs hash
    equally whatever the JSON spelling."""
    value = getattr(cfg, name)
    if positive:
        value = check_number(f"{type(cfg).__name__}.{name}", value, low=0.0, positive=True)
    else:
        value = check_number(f"{type(cfg).__name__}.{name}", value, low=low, high=high)
    object.__setattr__(cfg, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(JsonConfig):
    """The MiniLLM of M20 §2 and its variants: a stack of pre-norm residual layers, each a context mixer then
    an optional FFN (DESIGN §1, "Variants").

    ``mixer_pattern`` and ``ffn_pattern`` repeat to fill ``n_layers`` (layer ℓ uses kind ℓ mod the pattern's
    length); their lcm is the stack's period P. The default is the dense MiniLLM: GQA attention and SwiGLU in
    every layer, with M20's parameter layout. Fields a kind needs are required only when a layer uses it.

    ``n_heads * d_head`` need not equal ``d_model`` (the generalisation of M20 §8's count).
    ``vocab_used``: how many of the ``vocab_size`` embedding rows are tokens, when the tokenizer has fewer ids than
    the embedding has rows (a padded vocabulary: Qwen2/Qwen3 have 151,936 rows for 151,665 ids, so the matrix
    splits evenly over devices); unset: all of them. The padding rows are parameters like any other, but generation
    never chooses them (their logits are −∞ when sampling, decode/generate.py), so every generated id decodes.
    ``causal`` false makes every attention layer bidirectional within a document (the masked-diffusion denoiser of
    M20 §19, objectives/diffusion.py); such a model has no KV cache and no next-token decoding.
    ``rope_scale`` multiplies every position before rotation (position interpolation, U19 §7):
    0.25 makes position 6000 act as 1500.

    RoPE scaling (``rope_scaling``, layers/rope_scaling.py; each equal to transformers' ``ROPE_INIT_FUNCTIONS``):
    "none"; "linear" (position interpolation by ``rope_scale``, above; a config with rope_scale ≠ 1 is "linear");
    "llama3" (Llama 3.1's frequency bands: wavelengths longer than original/``rope_low_freq_factor`` are divided
    by ``rope_factor``, shorter than original/``rope_high_freq_factor`` kept, smoothly blended between);
    "yarn" (Peng et al. 2023, "YaRN": NTK-by-parts interpolation between dimensions that turn fewer than
    ``rope_beta_slow`` and more than ``rope_beta_fast`` times over ``rope_original_max_len``, plus the attention
    temperature ``rope_attention_factor``, default 0.1·ln(factor) + 1 or the ratio of ``rope_mscale`` and
    ``rope_mscale_all_dim`` terms); "dynamic" (dynamic NTK: beyond ``rope_original_max_len`` positions the base
    grows as base·((s·T/T₀) − (s − 1))^(d_h/(d_h−2)) for the longest position T of the call).
    ``rope_original_max_len`` defaults to ``max_seq_len``.

    ``qkv_bias`` adds biases to the Q, K and V projections (Qwen2); ``qk_norm`` applies a per-head RMSNorm over
    d_h to Q and K before RoPE (Qwen3; gains ``q_norm``, ``k_norm``). Mixer kind "local" is attention that reads
    only the last ``sliding_window`` positions (itself included; Mistral, Beltagy et al. 2020's Longformer
    window); alternating "local" and "attn" in ``mixer_pattern`` gives local/global stacks. Decoding keeps a
    ring buffer of ``sliding_window`` slots per local layer, so its cache stops growing with the context.

    Mixture of experts (M20 §15, U19 §3): ``n_experts`` routed experts X, ``n_shared_experts`` S (always run),
    ``moe_top_k`` k selected per token, each expert a SwiGLU of width ``moe_d_ff``; ``router`` "sigmoid"
    (M20 §15: w_e = a_e/(ε_r + Σ_S a_j), ε_r = ``router_eps``) or "softmax" (U19 §3: softmax over the selected
    logits); ``offset_rate`` u of the balancing rule b_e ← b_e + u·sign(mean load − load_e) (0 turns it off).

    Mamba-1 mixer (Gu & Dao 2023, M20 §19): state size N = ``ssm_state``, causal conv width W = ``ssm_conv``,
    inner width I = ``ssm_expand``·d, Δ rank R = ``ssm_dt_rank`` (unset: ⌈d/16⌉, as published); ``ssm_scan``
    "fused" (one pass over positions, hand-written backward; fastest on CPU), "associative" (log depth over
    materialised (B, T, I, N) tensors), "chunked" (sequential over chunks, associative inside, memory flat in T)
    or "auto": how training and prefill run the recurrence (layers/mamba.py, kernels/ssm_scan.py).

    The knobs of the speedrun stacks (modded-nanogpt, nanochat) and of Gemma 2/3, each off by default:
    ``attn_softcap`` c_a: every attention score s (after its 1/√d scaling) becomes c_a·tanh(s/c_a) before the mask
    and softmax (Gemma 2); ``logit_softcap`` c_o: the output logits Λ become c_o·tanh(Λ/c_o) (Gemma 2, modded-nanogpt).
    A cap is ≥ 1 (``SOFTCAP_MIN``): it confines every value to (−c, c), so any two tokens' odds differ by less than
    e^{2c}, and a smaller cap flattens every distribution whatever the model learns (Gemma 2: 50 and 30).
    FFN kinds "geglu" ([GELU_tanh(Y W_gate) ⊙ Y W_up] W_down, Shazeer 2020; Gemma) and "relu2" (max(0, Y W_up)²
    W_down, So et al. 2021's squared ReLU; modded-nanogpt). ``value_embeds``: each attention layer ℓ has its own
    table E^v_ℓ (V, h_kv, d_h) and gate λ_ℓ (init 1/2), V = X W^V + λ_ℓ·E^v_ℓ[x] (modded-nanogpt's value
    embeddings). ``unet_skips``: layer i ≥ L/2 reads H + w_{i−L/2}·H_{L−1−i}, H_j the output of layer j < L/2,
    weights w (init 1) at the top level (modded-nanogpt's U-net). ``zero_init_out``: the residual writers (W^O,
    W_down, the experts' down projections, Mamba's out_proj) start at zero (modded-nanogpt), their draws still
    taken. ``sandwich_norm``: Z = H + N_post(A(N(H))), H' = Z + N_post'(F(N(Z))) (Gemma 2/3: a norm after each
    sublayer too, gains ``post_attn_norm``, ``post_ffn_norm``). ``norm_unit_offset``: every RMSNorm gain is
    stored as w and applied as (1 + w), initialised at 0 (Gemma's parametrisation). ``embed_scale``: H⁽⁰⁾ =
    √d·E[x] (Gemma; the output projection stays E or U). ``rope_local_base``: the 'local' layers rotate with
    plain RoPE at this base, the others with ``rope_base`` and ``rope_scaling`` (Gemma 3). ``score_dim`` s:
    scores are q·k/√s instead of q·k/√d_h (Gemma's query_pre_attn_scalar). ``window_warmup_steps`` S_w: in
    training the 'local' layers' window grows from ``window_warmup_start`` w₀ (default W/8) to W over S_w
    updates (``model.training_window``; modded-nanogpt's window warmup); inference always uses W.
    ``mtp_depth`` D: D multi-token-prediction modules (DeepSeek-V3, model.mtp_hidden) trained beside the model,
    predicting tokens t+2 … t+D+1 through the shared embedding and output head; generation never uses them. A
    training window must be longer than D (``check_mtp_window``): module k predicts k + 1 positions ahead.
    ``parametrization`` "sp" (standard) or "mup" (the maximal-update parametrization of Yang et al. 2022, "Tensor
    Programs V", relative to a base model of width ``mup_base_width``: every rule is the identity at d_model =
    mup_base_width, so hyperparameters tuned there transfer to wider models; the base is at most ``MUP_WIDER_MAX``
    = 16 times wider than the model, as is ``mup_base_head_width`` than d_head). Its rules come from the layout
    (layers/layout.py): the output multiplier 1/m on the logits (m = d_model / mup_base_width), the unembedding's
    initial σ of the base width, the attention logit scale √d₀/d_h (d₀ = ``mup_base_head_width``; 1/d_h when
    unset) and per-parameter learning-rate multipliers in the optimizer (``train.optim.mup_lr_scales``). Attention
    and SwiGLU layers only.
    """

    vocab_size: int
    vocab_used: int | None = None
    d_model: int
    n_layers: int
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_ff: int | None = None
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    causal: bool = True
    max_seq_len: int
    mixer_pattern: tuple[str, ...] = ("attn",)
    ffn_pattern: tuple[str, ...] = ("swiglu",)
    n_experts: int | None = None
    n_shared_experts: int = 0
    moe_top_k: int | None = None
    moe_d_ff: int | None = None
    router: str = "sigmoid"
    router_eps: float = 1e-9
    offset_rate: float = 0.0
    ssm_state: int = 16
    ssm_conv: int = 4
    ssm_expand: int = 2
    ssm_dt_rank: int | None = None
    ssm_scan: str = "fused"
    # The knobs of the speedrun stacks and of Gemma (each off by default: the model is then exactly the one above)
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    value_embeds: bool = False
    unet_skips: bool = False
    zero_init_out: bool = False
    sandwich_norm: bool = False
    norm_unit_offset: bool = False
    embed_scale: bool = False
    rope_local_base: float | None = None
    score_dim: float | None = None
    window_warmup_steps: int = 0
    window_warmup_start: int | None = None
    mtp_depth: int = 0
    parametrization: str = "sp"
    mup_base_width: int | None = None
    mup_base_head_width: int | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            _require_int(self, name, minimum=1)
        for name in ("rope_base", "rope_scale", "norm_eps"):
            _require_float(self, name, positive=True)
        for name in ("tie_embeddings", "causal", "qkv_bias", "qk_norm", "rope_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} = {getattr(self, name)!r} is invalid: it must be true or false")
        self._check_patterns()
        if not self.causal and set(self.mixer_pattern) != {"attn"}:
            raise ConfigError("ModelConfig.causal = false cannot be used with Mamba or sliding-window layers: they "
                              "read only earlier positions; a bidirectional denoiser needs mixer_pattern ['attn']")
        for kind in sorted(set(self.mixer_pattern) | set(self.ffn_pattern)):
            for name in _NEEDS[kind]:
                if getattr(self, name) is None:
                    raise ConfigError(f"ModelConfig.{name} is not set: layers of kind {kind!r} need it "
                                      f"(a positive integer)")
        for name in ("n_heads", "n_kv_heads", "d_head", "d_ff", "n_experts", "moe_top_k", "moe_d_ff", "sliding_window",
                     "vocab_used"):
            if getattr(self, name) is not None:
                _require_int(self, name, minimum=1)
        if self.vocab_used is not None and self.vocab_used >= self.vocab_size:
            raise ConfigError(f"ModelConfig.vocab_used = {self.vocab_used} is invalid: it counts the token rows of a "
                              f"padded vocabulary, so it must be < vocab_size = {self.vocab_size} (or unset)")
        _require_int(self, "n_shared_experts", minimum=0)
        if self.attention:
            self._check_attention()
            self._check_rope()
        if "moe" in self.ffn_pattern:
            self._check_moe()
        if "mamba" in self.mixer_pattern:
            self._check_mamba()
        self._check_knobs()
        self._check_parametrization()

    def _check_patterns(self) -> None:
        for name, kinds in (("mixer_pattern", MIXER_KINDS), ("ffn_pattern", FFN_KINDS)):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value:
                raise ConfigError(f"ModelConfig.{name} = {value!r} is invalid: it must be a non-empty list of kinds "
                                  f"from {list(kinds)}")
            bad = [k for k in value if k not in kinds]
            if bad:
                raise ConfigError(f"ModelConfig.{name} = {list(value)!r} has unknown kind(s) {bad}: valid kinds "
                                  f"are {list(kinds)}")
            object.__setattr__(self, name, tuple(value))  # JSON gives lists; a tuple keeps the config hashable
        if self.n_layers % self.period:
            raise ConfigError(
                f"ModelConfig.n_layers = {self.n_layers} is not a multiple of the stack's period {self.period} (the "
                f"lcm of mixer_pattern length {len(self.mixer_pattern)} and ffn_pattern length "
                f"{len(self.ffn_pattern)}): the patterns must tile the stack exactly")

    def _check_attention(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.n_kv_heads}: "
                f"GQA needs an integer number of query heads per key/value head (valid n_kv_heads: "
                f"{[g for g in range(1, self.n_heads + 1) if self.n_heads % g == 0]})"
            )
        if self.d_head % 2:
            raise ConfigError(
                f"ModelConfig.d_head = {self.d_head} is odd: RoPE rotates coordinate pairs, so d_head must be even"
            )

    def _check_rope(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"ModelConfig.rope_scaling = {self.rope_scaling!r} is invalid: valid types are "
                              f"{list(ROPE_SCALINGS)}")
        if self.rope_scale != 1.0 and self.rope_scaling == "none":  # configs written before rope_scaling existed
            object.__setattr__(self, "rope_scaling", "linear")
        if self.rope_scale != 1.0 and self.rope_scaling != "linear":
            raise ConfigError(f"ModelConfig.rope_scale = {self.rope_scale!r} is linear position interpolation: it "
                              f"cannot be combined with rope_scaling = {self.rope_scaling!r} (set rope_scale to 1)")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                     "rope_beta_slow"):
            _require_float(self, name, positive=True)
        for name in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
            if getattr(self, name) is not None:
                _require_float(self, name, positive=True)
        if self.rope_original_max_len is not None:
            _require_int(self, "rope_original_max_len", minimum=1)
        if self.rope_scaling in ("llama3", "yarn", "dynamic") and not self.rope_factor >= 1.0:
            raise ConfigError(f"ModelConfig.rope_factor = {self.rope_factor!r} is invalid for rope_scaling = "
                              f"{self.rope_scaling!r}: the context-extension factor must be >= 1")
        if self.rope_scaling == "dynamic" and self.d_head <= 2:
            raise ConfigError(f"ModelConfig.d_head = {self.d_head} is invalid for rope_scaling = 'dynamic': its base "
                              f"grows with the exponent d_h/(d_h − 2), so d_head must be > 2")
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"ModelConfig.rope_high_freq_factor = {self.rope_high_freq_factor!r} must exceed "
                              f"rope_low_freq_factor = {self.rope_low_freq_factor!r} (llama3 blends between them)")

    @property
    def rope_original_len(self) -> int:
        """T₀, the context the RoPE scaling extends (``rope_original_max_len``, default ``max_seq_len``)."""
        return self.rope_original_max_len or self.max_seq_len

    def _check_moe(self) -> None:
        if not 1 <= self.moe_top_k <= self.n_experts:
            raise ConfigError(f"ModelConfig.moe_top_k = {self.moe_top_k} is invalid: it must be in [1, n_experts = "
                              f"{self.n_experts}]")
        if self.router not in ROUTERS:
            raise ConfigError(f"ModelConfig.router = {self.router!r} is invalid: valid routers are {list(ROUTERS)}")
        _require_float(self, "router_eps", low=0.0, high=1.0)
        _require_float(self, "offset_rate", low=0.0, high=1.0)

    def _check_mamba(self) -> None:
        for name in ("ssm_state", "ssm_conv", "ssm_expand"):
            _require_int(self, name, minimum=1)
        if self.ssm_dt_rank is None:  # the published default, written into the config so JSON shows it
            object.__setattr__(self, "ssm_dt_rank", -(-self.d_model // 16))
        _require_int(self, "ssm_dt_rank", minimum=1)
        if self.ssm_scan not in SSM_SCANS:
            raise ConfigError(f"ModelConfig.ssm_scan = {self.ssm_scan!r} is invalid: valid scans are "
                              f"{list(SSM_SCANS)}")

    def _check_knobs(self) -> None:
        """The speedrun / Gemma knobs: types, ranges, and the layers each one needs."""
        for name in ("value_embeds", "unet_skips", "zero_init_out", "sandwich_norm", "norm_unit_offset",
                     "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} = {getattr(self, name)!r} is invalid: it must be true or false")
        for name in ("attn_softcap", "logit_softcap", "rope_local_base", "score_dim"):
            if getattr(self, name) is not None:
                _require_float(self, name, positive=True)
        for name, what in (("attn_softcap", "attention score"), ("logit_softcap", "output logit")):
            cap = getattr(self, name)
            if cap is not None and cap < SOFTCAP_MIN:
                raise ConfigError(f"ModelConfig.{name} = {cap!r} is invalid: a soft cap c confines every {what} to "
                                  f"(-c, c), so below {SOFTCAP_MIN:g} it flattens them all towards 0 (no two tokens' "
                                  f"odds can differ by e^2); give c >= {SOFTCAP_MIN:g} (Gemma 2: 50 for scores, 30 "
                                  f"for logits), or leave it unset")
        for name in ("attn_softcap", "value_embeds", "rope_local_base", "score_dim"):
            if getattr(self, name) not in (None, False) and not self.attention:
                raise ConfigError(f"ModelConfig.{name} = {getattr(self, name)!r} acts on attention layers, but "
                                  f"mixer_pattern {list(self.mixer_pattern)} has none")
        # the same model written one way only (so a config survives a round trip through transformers' fields)
        if self.score_dim is not None and self.score_dim == self.d_head:
            object.__setattr__(self, "score_dim", None)
        if self.rope_local_base is not None and self.rope_local_base == self.rope_base and self.rope_scaling == "none":
            object.__setattr__(self, "rope_local_base", None)
        if self.rope_local_base is not None and "local" not in self.mixer_pattern:
            raise ConfigError(f"ModelConfig.rope_local_base = {self.rope_local_base!r} is the RoPE base of the "
                              f"sliding-window ('local') layers, but mixer_pattern {list(self.mixer_pattern)} has "
                              f"none")
        if self.sandwich_norm and "mamba" in self.mixer_pattern:
            raise ConfigError("ModelConfig.sandwich_norm = true normalises attention and FFN outputs (Gemma 2/3); "
                              "it is not defined for Mamba layers (mixer_pattern has 'mamba')")
        if self.unet_skips:
            half = self.n_layers // 2
            if self.n_layers % 2 or half % self.period:
                raise ConfigError(f"ModelConfig.unet_skips = true pairs layer i with layer L − 1 − i, so n_layers "
                                  f"= {self.n_layers} must be even and its half ({half}) a multiple of the stack's "
                                  f"period {self.period}")
        _require_int(self, "window_warmup_steps", minimum=0)
        if self.window_warmup_steps:
            if "local" not in self.mixer_pattern:
                raise ConfigError(f"ModelConfig.window_warmup_steps = {self.window_warmup_steps} grows the sliding "
                                  f"window of the 'local' layers, but mixer_pattern {list(self.mixer_pattern)} has "
                                  f"none")
            if self.window_warmup_start is None:  # written into the config, so its JSON shows it
                object.__setattr__(self, "window_warmup_start", max(1, self.sliding_window // 8))
            _require_int(self, "window_warmup_start", minimum=1, maximum=self.sliding_window)
        elif self.window_warmup_start is not None:
            raise ConfigError(f"ModelConfig.window_warmup_start = {self.window_warmup_start!r} is the first window "
                              f"of a window warmup, but window_warmup_steps = 0 (off): set both, or neither")
        _require_int(self, "mtp_depth", minimum=0, maximum=64)
        if self.mtp_depth and not self.causal:
            raise ConfigError("ModelConfig.mtp_depth predicts later tokens from earlier ones: a bidirectional model "
                              "(causal = false) has no next-token head to extend")

    def _check_parametrization(self) -> None:
        if self.parametrization not in layout.PARAMETRIZATIONS:
            raise ConfigError(f"ModelConfig.parametrization = {self.parametrization!r} is invalid: valid values are "
                              f"{list(layout.PARAMETRIZATIONS)}")
        given = [f"{name} = {getattr(self, name)!r}" for name in ("mup_base_width", "mup_base_head_width")
                 if getattr(self, name) is not None]
        if self.parametrization == "sp":
            if given:
                raise ConfigError(f"ModelConfig: {', '.join(given)} set(s) the μP base model, but parametrization = "
                                  f"'sp': give parametrization = 'mup', or drop them")
            return
        if self.mup_base_width is None:
            raise ConfigError("ModelConfig.mup_base_width is not set: parametrization = 'mup' scales every rule by "
                              "d_model / mup_base_width (a positive integer: the width the hyperparameters were tuned at)")
        self._check_mup_base("mup_base_width", "d_model", self.d_model)
        if self.mup_base_head_width is not None:
            self._check_mup_base("mup_base_head_width", "d_head", self.d_head or 1)
        knobs = [f"{name} = {getattr(self, name)!r}" for name in ("value_embeds", "unet_skips", "mtp_depth",
                                                                   "score_dim", "embed_scale")
                 if getattr(self, name) not in (None, False, 0)]
        if knobs:
            raise ConfigError(f"ModelConfig.parametrization = 'mup' has no rules for {', '.join(knobs)} (parameters "
                              f"or scales outside the standard stack): turn them off, or use parametrization = 'sp'")
        bad = sorted((set(self.mixer_pattern) - set(MUP_MIXERS)) | (set(self.ffn_pattern) - set(MUP_FFNS)))
        if bad:
            raise ConfigError(f"ModelConfig.parametrization = 'mup' has no rules for layer kind(s) {bad} (a router "
                              f"and Mamba's B/C projections are output-like matrices inside the stack): μP here "
                              f"covers mixers {list(MUP_MIXERS)} and FFNs {list(MUP_FFNS)}")

    def _check_mup_base(self, name: str, width: str, value: int) -> None:
        """A μP base width: a positive integer at most ``MUP_WIDER_MAX`` times the model's own ``width``."""
        _require_int(self, name, minimum=1)
        if getattr(self, name) > MUP_WIDER_MAX * value:
            raise ConfigError(f"ModelConfig.{name} = {getattr(self, name)} is invalid: it is the width the "
                              f"hyperparameters were tuned at, at most {MUP_WIDER_MAX} x {width} = "
                              f"{MUP_WIDER_MAX * value} (the width multiplier m = {width} / {name} scales the logits "
                              f"by 1/m, so a base far wider than the model blows them up)")

    @property
    def width_mult(self) -> float:
        """m = d_model / mup_base_width under μP (layers/layout.py), 1 under SP."""
        return layout.width_mult("D", self)

    # ----- the stack ---------------------------------------------------------------------------------
    @property
    def attention(self) -> bool:
        """Whether any layer is attention (full or sliding-window)."""
        return any(k in ATTENTION_KINDS for k in self.mixer_pattern)

    def window(self, kind: str) -> int | None:
        """The number of positions a query of mixer kind ``kind`` reads (itself included): ``sliding_window``
        for "local", None (every earlier position) otherwise."""
        return self.sliding_window if kind == "local" else None

    @property
    def period(self) -> int:
        """P = lcm of the pattern lengths: layer ℓ and layer ℓ + P are of the same kinds."""
        return math.lcm(len(self.mixer_pattern), len(self.ffn_pattern))

    @property
    def uniform(self) -> bool:
        """Both patterns of length 1: ``params["blocks"]`` is one dict stacked over L (else a list of P)."""
        return len(self.mixer_pattern) == 1 and len(self.ffn_pattern) == 1

    def layer_kinds(self, layer: int) -> tuple[str, str]:
        """(mixer kind, FFN kind) of layer ``layer`` (0-based)."""
        return self.mixer_pattern[layer % len(self.mixer_pattern)], self.ffn_pattern[layer % len(self.ffn_pattern)]

    @property
    def group_kinds(self) -> tuple[tuple[str, str], ...]:
        """The kinds of the P layers of one period (entry j of a mixed ``params["blocks"]``)."""
        return tuple(self.layer_kinds(j) for j in range(self.period))

    # ----- derived sizes -------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        """Query heads per key/value head, h_q / h_kv (M20 §6)."""
        return self.n_heads // self.n_kv_heads

    def mixer_param_count(self, kind: str) -> int:
        """One mixer branch with its norm gain: attention 2d·h_q·d_h + 2d·h_kv·d_h + d (M20 §8); Mamba
        ``mamba_param_count``. Summed from the kind's declaration in ``layers.layout``."""
        if kind not in MIXER_KINDS:
            raise ConfigError(f"no parameter count for mixer kind {kind!r}; valid kinds are {list(MIXER_KINDS)}")
        return layout.count(layout.KINDS[kind], self)

    def mamba_param_count(self) -> int:
        """One Mamba mixer with its norm gain: d (norm) + 2dI (in_x, in_z) + WI + I (conv) + IR + RI + I (Δ)
        + 2IN (w_B, w_C) + IN (A_log) + I (D) + Id (out_proj)."""
        return self.mixer_param_count("mamba")

    def ffn_param_count(self, kind: str, *, active: bool = False) -> int:
        """One FFN branch with its norm gain: SwiGLU 3dm + d (M20 §8); MoE d + dX (router) + 3d·m_e per expert,
        all X + S stored, k + S used by one token (U19 §3); none 0. Balancing offsets are routing state, not θ.
        Summed from the kind's declaration in ``layers.layout``."""
        if kind not in FFN_KINDS:
            raise ConfigError(f"no parameter count for FFN kind {kind!r}; valid kinds are {list(FFN_KINDS)}")
        return layout.count(layout.KINDS[kind], self, active=active)

    def _count(self, active: bool) -> int:
        return (layout.count(layout.TOP, self) + layout.stack_count(self, active=active)
                + layout.mtp_count(self, active=active))

    def param_count(self) -> int:
        """Trainable parameters θ, closed form (M20 §8 generalised to ``n_heads * d_head != d_model`` and to
        every layer kind): n_E·V·d + Σ_ℓ (mixer_ℓ + FFN_ℓ) + d, n_E = 1 tied, 2 untied.

        Dense: P = n_E·V·d + L·(2·d·h_q·d_h + 2·d·h_kv·d_h + 3·d·m + 2·d) + d.
        The knobs' arrays count where they are declared (layers/layout.py): value embeddings V·h_kv·d_h + 1 per
        attention layer, sandwich norms d per sublayer, the U-net's L/2 skip weights, and ``mtp_depth`` D modules
        of 2d² + 2d plus one layer each (``layout.mtp_count``).
        """
        return self._count(active=False)

    def active_param_count(self) -> int:
        """Parameters one token's forward touches: every routed expert a token is not sent to is left out
        (k of X per MoE layer; shared experts and the router always count). Equals ``param_count`` without MoE.
        As usual, the whole embedding and unembedding tables count."""
        return self._count(active=True)

    def routing_state_count(self) -> int:
        """Scalars of routing state (not θ): X balancing offsets per MoE layer (M20 §15)."""
        return layout.stack_count(self, roles=("state",))

    def non_embedding_param_count(self) -> int:
        """Parameters outside the embedding/unembedding tables (the N of scaling-law fits): θ − n_E·V·d (less the
        value-embedding tables too, which are lookups like E)."""
        tables = (layout.count(layout.TOP, self, roles=("table",)) + layout.stack_count(self, roles=("table",))
                  + layout.mtp_count(self, roles=("table",)))
        return self.param_count() - tables


COMPUTE_DTYPES = ("float32", "bfloat16")
SCHEDULES = ("cosine", "wsd")  # TrainConfig.schedule (train/optim.py)
DECAY_SHAPES = ("1-sqrt", "linear")  # the wsd decay (optim.DECAY_SHAPES)
OPTIMIZERS = ("adamw", "muon", "normuon")  # TrainConfig.optimizer
PARAM_COUNTS = ("non_embedding", "total", "active")  # the N a tokens-per-parameter ratio multiplies (Sizing)


_MTP_WEIGHT = 0.3  # TrainConfig.mtp_weight's default


def check_seq_len(cfg: "ModelConfig", tcfg: "TrainConfig", model: str = "the model") -> None:
    """A training window must fit the model it trains: ``seq_len`` ≤ ``max_seq_len`` (the one check of every run
    kind; ``model`` names it in the message: "the model", "the base model"); and a non-default ``mtp_weight``
    needs MTP modules to weigh (never silently unused)."""
    if tcfg.mtp_weight != _MTP_WEIGHT and not cfg.mtp_depth:
        raise ConfigError(f"mtp_weight = {tcfg.mtp_weight!r} weighs the multi-token-prediction loss, but {model} "
                          f"has no MTP modules (mtp_depth = 0): set --set model.mtp_depth=D, or drop --mtp-weight")
    if tcfg.seq_len > cfg.max_seq_len:
        fix = "lower --seq-len" + (" or raise max_seq_len in the model config" if model == "the model" else "")
        raise ConfigError(f"seq_len = {tcfg.seq_len} is longer than {model}'s max_seq_len = {cfg.max_seq_len}: "
                          f"{fix}")


def check_mtp_window(cfg: "ModelConfig", tcfg: "TrainConfig") -> None:
    """A model with ``mtp_depth`` D trains D modules, module k predicting the token k + 1 positions ahead: a window
    of ``seq_len`` ≤ D leaves the deepest ones no target (their loss silently 0), so it is refused."""
    if cfg.mtp_depth and tcfg.seq_len <= cfg.mtp_depth:
        raise ConfigError(f"mtp_depth = {cfg.mtp_depth} needs training windows longer than itself (module k "
                          f"predicts k + 1 tokens ahead), but seq_len = {tcfg.seq_len}: raise --seq-len above "
                          f"{cfg.mtp_depth}, or lower model.mtp_depth below {tcfg.seq_len}")


_FIELD_DEFAULTS = {"decay_fraction": 0.2, "decay_shape": "1-sqrt"}  # TrainConfig's wsd fields, unset


def wsd_decay_steps(total_steps: int, decay_fraction: float) -> int:
    """D of a warmup-stable-decay schedule of ``total_steps`` (optim.warmup_stable_decay): round(F·S), at least 1."""
    return max(1, round(decay_fraction * total_steps))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(JsonConfig):
    """Everything the training loop needs besides the model (``train_config.json`` of a run).

    ``batch_size`` is sequences per optimizer step, split into ``grad_accum`` micro-batches; the loss is
    token-averaged over the whole step (M20 §10). ``lr`` is the peak of ``optim.warmup_cosine``.
    ``eval_tokens`` caps the validation targets scored per evaluation (0 = the whole split).
    ``objective`` "ar" (next-token cross-entropy, M20 §10) or "diffusion" (the masked-diffusion bound of
    objectives/diffusion.py; the model must be bidirectional and the tokenizer must have ``<|mask|>``).
    """

    batch_size: int = setting(32, "sequences per optimizer step (prompts per step for rl; pairs for reward "
                              "and dpo), split into --grad-accum micro-batches")
    seq_len: int = setting(256, "positions per training sequence")
    steps: int = setting(1000, "optimizer steps (on --resume: may only grow, extending the run)")
    lr: float = setting(3e-3, "peak learning rate of the schedule (warmup, then cosine or wsd)")
    warmup_steps: int = setting(50, "steps of linear warmup to the peak lr")
    final_lr_fraction: float = setting(0.1, "the cosine's end, as a fraction of the peak lr")
    clip_norm: float = setting(1.0, "global gradient-norm clip")
    weight_decay: float = setting(0.1, "AdamW weight decay (on every parameter but the RMSNorm gains)")
    b1: float = setting(0.9, "AdamW β₁")
    b2: float = setting(0.95, "AdamW β₂")
    grad_accum: int = setting(1, "micro-batches per step (gradients accumulated; the loss is the step's mean)")
    eval_interval: int = setting(250, "steps between evaluations (and one at the end)")
    eval_tokens: int = setting(0, "cap on the held-out targets scored per evaluation (0: all)")
    checkpoint_interval: int = setting(250, "steps between checkpoints (and one at the end)")
    keep_checkpoints: int = setting(2, "checkpoints kept (older ones are removed)")
    log_interval: int = setting(10, "steps between metric readbacks (metrics.jsonl, the progress bar)")
    seed: int = setting(0, "seed of the initialisation, the data order and the noise")
    init_seed: int | None = setting(None, "seed of the initial parameters (and LoRA adapters) alone, instead of "
                                    "--seed: runs that differ in it see the same batches (default: --seed)")
    data_seed: int | None = setting(None, "seed of the batch order and windows (and a task's examples) alone, instead "
                                    "of --seed: runs that differ in it start from the same parameters (default: "
                                    "--seed)")
    compute_dtype: str = setting("float32", "dtype of the forward and backward passes (float32 master weights)",
                                 choices=COMPUTE_DTYPES)
    objective: str = setting("ar", "ar (next token) or diffusion (masked diffusion: a bidirectional denoiser "
                             "trained on the NELBO bound)", choices=OBJECTIVES)
    mesh: str = setting("", "device mesh, e.g. data=2,fsdp=4 (axes data, fsdp, tensor; default: every device on "
                        "data); parameters and optimizer state are split along fsdp", metavar="AXIS=N,...")
    remat: str = setting("none", "recompute activations per layer in the backward pass: none, full or dots",
                         choices=REMAT_POLICIES)
    schedule: str = setting("cosine", "learning-rate schedule after the warmup: cosine (down to final_lr_fraction) "
                            "or wsd (warmup-stable-decay: the peak until the last decay_fraction of the steps, then "
                            "down to final_lr_fraction; Hägele et al. 2024)", choices=SCHEDULES)
    decay_fraction: float = setting(_FIELD_DEFAULTS["decay_fraction"], "wsd: share of the steps in the final decay, in (0, 1)")
    decay_shape: str = setting(_FIELD_DEFAULTS["decay_shape"], "wsd: shape of the decay, 1-sqrt (η ∝ 1 − √p, Hägele et al.'s best) or "
                               "linear", choices=DECAY_SHAPES)
    optimizer: str = setting("adamw", "adamw, muon (Newton–Schulz orthogonalised momentum on each layer's "
                             "matrices, AdamW on embeddings, norms and the rest; one lr for both) or normuon (Muon "
                             "with its update normalised per output neuron, Li et al. 2025)", choices=OPTIMIZERS)
    polar_express: bool = setting(False, "muon/normuon: orthogonalise with Polar Express's per-step optimal "
                                  "polynomials (Amsel et al. 2025) instead of the fixed Newton–Schulz quintic")
    cautious_wd: bool = setting(False, "cautious weight decay (Chen et al. 2025): decay only the coordinates whose "
                                "update has the parameter's sign")
    embed_lr_scale: float = setting(1.0, "learning-rate multiplier of the input tables (embedding, value "
                                    "embeddings)")
    head_lr_scale: float = setting(1.0, "learning-rate multiplier of the untied output head (tied: the "
                                   "embedding's)")
    scalar_lr_scale: float = setting(1.0, "learning-rate multiplier of the scalars (norm gains, biases, gates, "
                                     "skip weights, Mamba's elementwise parameters)")
    mtp_weight: float = setting(_MTP_WEIGHT, "weight λ of the multi-token-prediction loss, λ·mean of the "
                                "mtp_depth extra losses (needs model.mtp_depth > 0; DeepSeek-V3: 0.3)")
    z_loss: float = setting(0.0, "weight W of PaLM's z-loss, W·(log Z)² per target token added to the loss (0: off)")
    skip_spikes: bool = setting(False, "skip an update whose gradient norm exceeds --spike-factor × the running mean "
                                "of earlier ones (counted as spikes_skipped in the metrics)")
    spike_factor: float = setting(4.0, "with --skip-spikes: the factor k (> 1) over the running mean gradient norm")
    watch_interval: int = setting(0, "steps between per-layer RMS diagnostics of parameters, gradients and updates, "
                                  "computed in the step (0: off)")
    # Execution paths (kernels.Kernels; "auto" per backend): they change no number beyond float tolerance.
    attention_impl: str = setting("auto", "attention implementation (auto: splash on TPU, pallas_gpu on GPU, xla "
                                  "on the CPU below 512 positions; flash: blockwise, linear memory, any backend)",
                                  choices=ATTENTION_IMPLS)
    moe_impl: str = setting("auto", "MoE grouped product (auto: megablox on TPU, ragged_dot on GPU, block on the "
                            "CPU)", choices=MOE_IMPLS)
    loss_chunk: int | str = setting("auto", "rows of logits formed at a time by the loss (0: all; auto: chunked on "
                                    "accelerators, whole on the CPU)", metavar="N|auto")
    interpret_kernels: bool = setting(False, "run Pallas kernels in interpret mode (tests); never chosen by auto",
                                      cli=False)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"TrainConfig.objective = {self.objective!r} is invalid: valid objectives are "
                              f"{list(OBJECTIVES)}")
        for name in ("batch_size", "seq_len", "steps", "grad_accum", "eval_interval", "checkpoint_interval",
                     "keep_checkpoints", "log_interval"):
            _require_int(self, name, minimum=1)
        for name in ("warmup_steps", "eval_tokens"):
            _require_int(self, name, minimum=0)
        _require_int(self, "seed", minimum=0, maximum=SEED_MAX)
        for name in ("init_seed", "data_seed"):
            if getattr(self, name) is not None:
                _require_int(self, name, minimum=0, maximum=SEED_MAX)
        _require_float(self, "lr", positive=True)
        _require_float(self, "clip_norm", positive=True)
        _require_float(self, "final_lr_fraction", low=0.0, high=1.0)
        _require_float(self, "weight_decay", low=0.0, high=1.0)
        _require_float(self, "b1", low=0.0, high=0.999999)
        _require_float(self, "b2", low=0.0, high=0.999999)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"TrainConfig.warmup_steps = {self.warmup_steps} is invalid: it must be <= steps = "
                              f"{self.steps}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"TrainConfig.batch_size = {self.batch_size} is not divisible by grad_accum = "
                              f"{self.grad_accum}: each micro-batch must hold a whole number of sequences")
        parse_mesh(self.mesh)
        self._check_workflow()
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"TrainConfig.remat = {self.remat!r} is invalid: valid values are "
                              f"{list(REMAT_POLICIES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"TrainConfig.compute_dtype = {self.compute_dtype!r} is invalid: valid values are "
                              f"{list(COMPUTE_DTYPES)}")
        self.kernels()  # validates the execution-path fields

    def _check_workflow(self) -> None:
        """The schedule, optimizer and stability settings."""
        for name, valid in (("schedule", SCHEDULES), ("decay_shape", DECAY_SHAPES), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in valid:
                raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r} is invalid: valid values are "
                                  f"{list(valid)}")
        _require_float(self, "decay_fraction", low=0.0, high=1.0)
        if not 0 < self.decay_fraction < 1:
            raise ConfigError(f"TrainConfig.decay_fraction = {self.decay_fraction!r} is invalid: it must be in (0, 1)")
        wsd_only = [f"{name} = {getattr(self, name)!r}" for name in ("decay_fraction", "decay_shape")
                    if getattr(self, name) != _FIELD_DEFAULTS[name]]
        if self.schedule != "wsd" and wsd_only:
            raise ConfigError(f"TrainConfig: {', '.join(wsd_only)} shape(s) the wsd decay, but schedule = "
                              f"{self.schedule!r} has none: give --schedule wsd, or drop them")
        if self.schedule == "wsd" and self.warmup_steps + self.decay_steps > self.steps:
            raise ConfigError(f"TrainConfig: warmup_steps = {self.warmup_steps} plus the wsd decay ({self.decay_steps} "
                              f"steps, decay_fraction {self.decay_fraction:g} of {self.steps}) exceed steps = "
                              f"{self.steps}: lower --warmup-steps or --decay-fraction")
        _require_float(self, "z_loss", low=0.0, high=1.0)
        if self.z_loss and self.objective == "diffusion":
            raise ConfigError("TrainConfig.z_loss applies to the next-token loss: the diffusion objective has no "
                              "z-loss (set it to 0)")
        if not isinstance(self.skip_spikes, bool):
            raise ConfigError(f"TrainConfig.skip_spikes = {self.skip_spikes!r} is invalid: it must be true or false")
        _require_float(self, "spike_factor", positive=True)
        if not self.spike_factor > 1:
            raise ConfigError(f"TrainConfig.spike_factor = {self.spike_factor!r} is invalid: it must be > 1")
        _require_int(self, "watch_interval", minimum=0)
        self._check_optimizer_options()

    def _check_optimizer_options(self) -> None:
        for name in ("polar_express", "cautious_wd"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r} is invalid: it must be true or false")
        if self.polar_express and self.optimizer == "adamw":
            raise ConfigError("TrainConfig.polar_express = true replaces Muon's Newton–Schulz iteration: it needs "
                              "--optimizer muon or normuon (adamw orthogonalises nothing)")
        for name in ("embed_lr_scale", "head_lr_scale", "scalar_lr_scale"):
            _require_float(self, name, positive=True)
        _require_float(self, "mtp_weight", positive=True)
        if self.mtp_weight > 10:
            raise ConfigError(f"TrainConfig.mtp_weight = {self.mtp_weight!r} is invalid: it must be in (0, 10]")

    @property
    def params_seed(self) -> int:
        """The seed of the initial parameters: ``init_seed``, else ``seed``."""
        return self.seed if self.init_seed is None else self.init_seed

    @property
    def batch_seed(self) -> int:
        """The seed of the batch order and windows: ``data_seed``, else ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def decay_steps(self) -> int:
        """The wsd schedule's decay steps D (``wsd_decay_steps``)."""
        return wsd_decay_steps(self.steps, self.decay_fraction)

    def kernels(self, platform: str | None = None, *, resolve: bool = False):
        """The run's execution paths (``kernels.Kernels``), resolved for ``platform`` when ``resolve``."""
        k = Kernels(attention_impl=self.attention_impl, moe_impl=self.moe_impl, loss_chunk=self.loss_chunk,
                    interpret=self.interpret_kernels)
        return k.resolve(platform) if resolve else k


DEFAULT_LORA_TARGETS = ("wq", "wv")  # U19 §10's rule of thumb: query and value
LORA_TARGETS = layout.lora_targets()  # the weights LoRA can adapt: each declaration's ``lora_in`` (layers/layout.py)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (U19 §10; lora.py): rank r, scale α (the update is (α/r)·A·B) and the target keys."""

    rank: int = setting(8, "train rank-R adapters beside the frozen base instead of every weight (LoRA is off "
                        "unless --lora-rank is given)", show_default=False)
    alpha: float = setting(16.0, "α of the adapters' update (α/r)·A·B")
    targets: tuple[str, ...] = setting(DEFAULT_LORA_TARGETS, "comma-separated weight keys to adapt")

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank = {self.rank!r} is invalid: it must be a positive integer")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"LoRA alpha = {self.alpha!r} is invalid: it must be a positive number")
        targets = tuple(self.targets)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"LoRA targets {list(targets)!r} are invalid: choose distinct keys among "
                              f"{list(LORA_TARGETS)}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
