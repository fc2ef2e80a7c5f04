"""The transformers families researchers start from (interop/hf_config.py): Llama 3 (rope llama3), Qwen2 (q/k/v
biases, local/global layer_types, YaRN), Qwen3 (q/k norms, sliding window, dynamic NTK), Mistral (sliding
window), Qwen3-MoE (softmax router with norm_topk_prob), Gemma 2 (GeGLU, sandwich norms, (1 + w) gains, √d
embedding scale, attention and final soft caps, query_pre_attn_scalar, local/global) and Gemma 3 (the same with
q/k norms and a RoPE per layer type: linear scaling on the global layers, a base of their own on the local ones). Tiny random configs built by transformers itself (no
download): logits equal transformers' (f32, ≤ 1e-4), greedy generation gives the same tokens with prompts longer
than the window (the ring-buffer cache), import(export(x)) is bitwise, what transformers saves imports, an imported
model fine-tunes, samples and exports through the CLI, and what has no equivalent is refused by name."""

import dataclasses
import json
import os
import re
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import jax
import numpy as np
import pytest

from mlx_llm import ModelConfig, forward, generate, init_params
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.interop import export_model, export_run, import_hf, load_hf
from mlx_llm.data import tokenizer as tok_lib
from helpers import cli_in_process, snapshot
from test_hf_interop import CORPUS, LOGIT_TOL, _retensor, assert_same_params, hf_logits  # noqa: F401

pytestmark = pytest.mark.slow  # torch + transformers

W = 5  # the sliding window: prompts of 10 + 12 new tokens run far past it


def family_configs(v: int) -> dict:
    common = dict(vocab_size=v, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, max_seq_len=64,
                  norm_eps=1e-6)
    return {
        "llama": ModelConfig(**common, d_ff=48, rope_base=500.0, rope_scaling="llama3", rope_factor=8.0,
                             rope_original_max_len=16, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0),
        "qwen2": ModelConfig(**{**common, "n_layers": 4}, d_ff=40, qkv_bias=True, mixer_pattern=("local", "attn"),
                             sliding_window=W, rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16),
        "qwen3": ModelConfig(**common, d_ff=40, qk_norm=True, tie_embeddings=True, mixer_pattern=("local",),
                             sliding_window=W, rope_scaling="dynamic", rope_factor=2.0, rope_original_max_len=8),
        "mistral": ModelConfig(**common, d_ff=40, mixer_pattern=("local",), sliding_window=W),
        "qwen3_moe": ModelConfig(**common, qk_norm=True, ffn_pattern=("moe",), n_experts=4, moe_top_k=2,
                                 moe_d_ff=24, router="softmax"),
        "gemma2": ModelConfig(**common, **GEMMA, attn_softcap=2.0, logit_softcap=3.0, score_dim=16.0),
        "gemma3": ModelConfig(**{**common, "n_layers": 4}, **GEMMA, qk_norm=True, tie_embeddings=True,
                              rope_base=1e6, rope_scaling="linear", rope_scale=0.5, rope_local_base=1e4),
    }


# Gemma's fixed design (GeGLU, sandwich norms, (1 + w) gains, √d embedding scale) on local/global layers
GEMMA = dict(d_ff=40, ffn_pattern=("geglu",), sandwich_norm=True, norm_unit_offset=True, embed_scale=True,
             mixer_pattern=("local", "attn"), sliding_window=W)
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM"}


def nontrivial(params, seed: int):
    """Every gain and bias moved off its initial value; the router × 4 (tokens disagree on their experts)."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(np.asarray, params)
    groups = [params["blocks"]] if isinstance(params["blocks"], dict) else params["blocks"]
    out = []
    for g in groups:
        g = dict(g)
        for name in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv", "post_attn_norm", "post_ffn_norm"):
            if name in g:
                g[name] = (g[name] + 0.3 * rng.standard_normal(g[name].shape)).astype(np.float32)
        if "router" in g:
            g["router"] = 4.0 * g["router"]
        out.append(g)
    return {**params, "blocks": out[0] if len(out) == 1 else out,
            "final_norm": (params["final_norm"] + 0.3 * rng.standard_normal(params["final_norm"].shape)).astype(
                np.float32)}


@pytest.fixture(scope="module")
def hf():
    import torch
    import transformers

    return torch, transformers


@pytest.fixture(scope="module")
def tok():
    return tok_lib.train_bpe(CORPUS, 300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("families")
    init = jax.jit(init_params, static_argnums=0)
    out = {}
    for i, (arch, cfg) in enumerate(family_configs(tok.vocab_size).items()):
        params = nontrivial(init(cfg, jax.random.key(i, impl="rbg")), seed=20 + i)
        out[arch] = (cfg, params, export_model(params, cfg, tok, root / arch))
    return out


@pytest.fixture(scope="module")
def hf_models(hf, exported):
    _, transformers = hf
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(d) for arch, (_, _, d) in exported.items()}


@pytest.mark.parametrize("arch", list(CLASSES))
def test_transformers_logits_equal_ours(hf, exported, hf_models, arch):
    cfg, params, _ = exported[arch]
    model = hf_models[arch]
    assert type(model).__name__ == CLASSES[arch]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 40))  # 40 > 8·W and > every T₀ here
    ours = np.asarray(forward(params, ids, cfg))
    theirs = hf_logits(hf, model, ids)
    diff = float(np.abs(ours - theirs).max())
    print(f"{arch}: max |logit difference| {diff:.3g} (logit scale {np.abs(ours).max():.3g})")
    assert diff <= LOGIT_TOL


@pytest.mark.parametrize("arch", list(CLASSES))
def test_greedy_generation_equal(hf, exported, hf_models, arch, tok):
    """Under dynamic NTK transformers keeps the frequencies of the longest call so far in the module (the
    logits test ran 40 positions), so that model is loaded afresh: within one generate call the lengths only grow,
    and its frequencies are then ours, a function of the call's longest position."""
    torch, transformers = hf
    cfg, params, out_dir = exported[arch]
    model = hf_models[arch]
    if cfg.rope_scaling == "dynamic":
        model = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 10))
    n = 12
    ours = np.asarray(generate(params, cfg, prompt, n, eos_id=tok.eos_id, pad_id=tok.pad_id).tokens)
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                                       max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id,
                                       pad_token_id=tok.pad_id)
    theirs = out[:, prompt.shape[1]:].numpy()
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1]:] == tok.pad_id).all()


@pytest.mark.parametrize("arch", list(CLASSES))
def test_import_of_export_is_bitwise_identity(exported, tmp_path, arch):
    cfg, params, out = exported[arch]
    back = load_hf(out)
    assert back.cfg == cfg and back.hf_class == CLASSES[arch]
    assert_same_params(back.params, params)
    run = import_hf(out, tmp_path / "run")
    again = export_run(run, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((again / "config.json").read_text())["architectures"] == [CLASSES[arch]]


@pytest.mark.parametrize("arch", list(CLASSES))
def test_checkpoint_saved_by_transformers_imports(exported, hf_models, tmp_path, arch):
    """What transformers writes (save_pretrained: its own config keys, its own fused expert layout) imports to
    the same parameters; the ModelConfig differs at most in max_seq_len under dynamic NTK (which transformers
    stores as T₀)."""
    cfg, params, out = exported[arch]
    hf_models[arch].save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    saved.pop("mlx_llm", None)  # as if written by transformers alone
    (tmp_path / "saved" / "config.json").write_text(json.dumps(saved))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, tmp_path / "saved" / name)
    back = load_hf(tmp_path / "saved")
    want = dataclasses.replace(cfg, max_seq_len=cfg.rope_original_len) if cfg.rope_scaling == "dynamic" else cfg
    assert back.cfg == want
    assert_same_params(back.params, params)


# The command-line path (import → sft → generate → export) is the same code for every family once imported; each
# family's own import and export are checked above (logits, greedy tokens, bitwise round trips). It runs here for
# the plain family, the MoE one and Gemma 3 (norms, soft caps' absence, local/global layers); Gemma 2 differs from
# Gemma 3 on this path only by its soft caps, which a CLI run trains in tests/test_knobs.py.
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma3"])
def test_imported_model_finetunes_samples_and_exports_through_the_cli(exported, tmp_path, arch):
    _, _, out = exported[arch]
    assert cli_in_process("import", "--from", out, "--out", tmp_path / "base").returncode == 0
    proc = cli_in_process("sft", "--base", tmp_path / "base", "--out", tmp_path / "sft", "--task", "arithmetic",
                          "--steps", 2, "--warmup-steps", 1, "--batch-size", 2, "--seq-len", 32, "--eval-interval", 2)
    assert proc.returncode == 0, proc.stderr
    proc = cli_in_process("generate", "--run", tmp_path / "sft", "--prompt", "def ", "--max-new-tokens", 12, "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["continuation_ids"]) == 12
    proc = cli_in_process("export", "--run", tmp_path / "sft", "--to", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert load_hf(tmp_path / "hf").hf_class == CLASSES[arch]


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    hf.pop("mlx_llm", None)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(hf.get(key), dict):
            hf[key] = {**hf[key], **value}
        else:
            hf[key] = value
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


REFUSED = [
    ("llama", {"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("llama", {"rope_parameters": {"rope_type": "longrope"}}, "RoPE type 'longrope'"),
    ("llama", {"attention_bias": True}, "attention_bias = True"),
    ("qwen3", {"attention_bias": True}, "attention_bias = True"),
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob = False"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen2", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation = 'gelu'"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}},
     "sliding_attention layers' RoPE"),
]


@pytest.mark.parametrize("arch,changes,message", REFUSED)
def test_unsupported_features_refused_by_name(exported, tmp_path, arch, changes, message):
    src = _edit_config(exported[arch][2], tmp_path / "src", **changes)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hf(src)
    with pytest.raises(ConfigError):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch, changes, message", [
    ("gemma2", {"layer_types": []}, r"layer_types \[\] is invalid: one of \['full_attention', 'sliding_attention'\] "
                                    r"per layer \(2 layers\)"),
    ("qwen2", {"layer_types": []}, r"layer_types \[\] is invalid"),
    ("gemma2", {"head_dim": 0}, r"head_dim = 0 is invalid: it must be a positive integer"),
    ("gemma3", {"num_key_value_heads": 0}, r"num_key_value_heads = 0 is invalid: it must be a positive integer"),
    ("gemma2", {"query_pre_attn_scalar": 1e30}, r"query_pre_attn_scalar = 1e\+30 is invalid: it must be an integer "
                                                r"from 1 to 16,777,216"),
    ("gemma3", {"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar = 0 is invalid"),
    ("gemma2", {"query_pre_attn_scalar": 12.5}, r"query_pre_attn_scalar = 12.5 is invalid"),
])
def test_values_a_fallback_would_replace_are_refused_naming_the_field(exported, tmp_path, arch, changes, message):
    """``layer_types: []``, ``head_dim: 0`` and ``num_key_value_heads: 0`` fell back to the class defaults (``x or
    default``) and ``query_pre_attn_scalar: 1e30`` was taken as a score scale: each imported silently. Each is
    refused in one line naming the field; nothing is written and the source is unchanged."""
    src = _edit_config(exported[arch][2], tmp_path / "src", **changes)
    before = snapshot(src)
    proc = cli_in_process("import", "--from", src, "--out", tmp_path / "run")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("mlx-llm import: error: ") and re.search(message, proc.stderr), proc.stderr
    assert snapshot(src) == before and not (tmp_path / "run").exists()


def test_gemma_fields_absent_or_null_take_the_class_defaults(exported, tmp_path):
    """What is refused above is a value, not an absence: a missing or null layer_types / head_dim /
    num_key_value_heads still takes transformers' default."""
    from mlx_llm.interop import hf_config

    src = _edit_config(exported["gemma2"][2], tmp_path / "src", layer_types=None, head_dim=None,
                       num_key_value_heads=None)
    cfg = hf_config.from_hf(json.loads((src / "config.json").read_text()), "gemma2", "config.json")
    assert (cfg.mixer_pattern, cfg.d_head, cfg.n_kv_heads) == (("local", "attn"), 32 // 4, 4)


def test_layer_types_become_the_mixer_pattern(exported, tmp_path):
    """Qwen's max_window_layers rule (full attention below it, windows above) is a pattern of length L."""
    src = _edit_config(exported["qwen2"][2], tmp_path / "src", max_window_layers=3, use_sliding_window=True,
                       layer_types=None)
    assert load_hf(src).cfg.mixer_pattern == ("attn", "attn", "attn", "local")
    src = _edit_config(exported["qwen2"][2], tmp_path / "src2", use_sliding_window=False, layer_types=None)
    assert load_hf(src).cfg.mixer_pattern == ("attn",)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.0.self_attn.q_norm.weight"), "q_norm.weight' is missing"),
    (lambda t: t.update({"model.layers.1.self_attn.k_norm.weight": np.ones(4, np.float32)}), "has shape"),
])
def test_missing_or_misshapen_weights_refused(exported, tmp_path, edit, message):
    src = _retensor(exported["qwen3"][2], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_export_chooses_the_class_or_refuses_by_name(tok, tmp_path):
    cfgs = family_configs(tok.vocab_size)
    both = dataclasses.replace(cfgs["qwen3"], qkv_bias=True)
    params = jax.jit(init_params, static_argnums=0)(both, jax.random.key(0, impl="rbg"))
    with pytest.raises(ConfigError, match="qkv_bias"):
        export_model(params, both, tok, tmp_path / "x")
    mixed = dataclasses.replace(cfgs["mistral"], n_layers=2, mixer_pattern=("local", "attn"))
    with pytest.raises(ConfigError, match="no sliding window|windows every layer|layer_types"):
        export_model(jax.jit(init_params, static_argnums=0)(mixed, jax.random.key(0, impl="rbg")), mixed, tok,
                     tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_padded_vocabulary_imports_generates_only_tokens_and_round_trips(hf, tok, tmp_path):
    """Qwen's embedding has more rows than its tokenizer has ids (151,936 for 151,665): import keeps every row
    and records ``vocab_used``; logits equal transformers' over all rows; generation never picks a padding row —
    made the most likely here — and equals transformers' with those ids suppressed; export writes the same
    checkpoint back."""
    torch, transformers = hf
    pad = 12
    cfg = dataclasses.replace(family_configs(tok.vocab_size + pad)["qwen2"], vocab_used=tok.vocab_size)
    params = nontrivial(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(9, impl="rbg")), seed=9)
    params["unembed"] = params["unembed"].copy()
    params["unembed"][:, tok.vocab_size:] = 5.0 * np.abs(params["unembed"]).max()  # padding would win argmax
    out = export_model(params, cfg, tok, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == tok.vocab_size + pad
    back = load_hf(out)
    assert back.cfg == cfg and back.tok.vocab_size == tok.vocab_size
    assert_same_params(back.params, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = np.random.default_rng(3).integers(0, tok.vocab_size, (2, 20))
    assert float(np.abs(np.asarray(forward(params, ids, cfg)) - hf_logits(hf, model, ids)).max()) <= LOGIT_TOL
    prompt, n = ids[:, :8], 10
    ours = np.asarray(generate(params, cfg, prompt, n, eos_id=tok.eos_id, pad_id=tok.pad_id).tokens)
    assert ours.max() < tok.vocab_size
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                                max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                                suppress_tokens=list(range(tok.vocab_size, cfg.vocab_size)))[:, 8:].numpy()
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)
    beams = np.asarray(generate(params, cfg, prompt, 4, beam_width=3, eos_id=tok.eos_id, pad_id=tok.pad_id).tokens)
    assert beams.max() < tok.vocab_size
    run = import_hf(out, tmp_path / "run")
    assert (export_run(run, tmp_path / "again") / "model.safetensors").read_bytes() == \
        (out / "model.safetensors").read_bytes()
    proc = cli_in_process("generate", "--run", run, "--prompt", "def ", "--max-new-tokens", 6, "--json")
    assert proc.returncode == 0 and max(json.loads(proc.stdout)["continuation_ids"]) < tok.vocab_size, proc.stderr


def test_nonzero_offsets_are_named_by_their_layer_in_a_local_global_stack(tok):
    """Layer ℓ of a stack of period P is row ℓ // P of group ℓ mod P: the refusal names ℓ, not the group order."""
    from mlx_llm.interop.hf import check_offsets

    cfg = dataclasses.replace(family_configs(tok.vocab_size)["qwen3_moe"], n_layers=4, mixer_pattern=("local", "attn"),
                              sliding_window=W)
    groups = [{"router_offset": np.zeros((2, 4), np.float32)} for _ in range(cfg.period)]
    groups[1]["router_offset"][0, 2] = 0.5  # group 1 (attn), row 0: layer 1
    groups[0]["router_offset"][1, 3] = 0.25  # group 0 (local), row 1: layer 2
    with pytest.raises(ConfigError, match=r"2 balancing offset\(s\).*layer 1 expert 2: 0\.5, layer 2 expert 3: 0\.25"):
        check_offsets({"blocks": groups}, cfg, "Qwen3MoeForCausalLM")


def test_knobs_without_an_equivalent_are_refused_or_dropped_by_name(tok, tmp_path):
    """A Gemma knob on another class, a ReLU² FFN and value embeddings are refused by name; the MTP modules are
    dropped with a line (generation never uses them); an initialisation or a training-time window rides along."""
    cfgs = family_configs(tok.vocab_size)
    init = jax.jit(init_params, static_argnums=0)
    for cfg, message in ((dataclasses.replace(cfgs["llama"], attn_softcap=5.0), "soft-capping exists in Gemma"),
                         (dataclasses.replace(cfgs["llama"], ffn_pattern=("relu2",)), r"ffn_pattern \['relu2'\]"),
                         (dataclasses.replace(cfgs["llama"], value_embeds=True), r"\['value_embeds'\]"),
                         (dataclasses.replace(cfgs["gemma2"], sandwich_norm=False), "sandwich_norm")):
        with pytest.raises(ConfigError, match=message):
            export_model(init(cfg, jax.random.key(0, impl="rbg")), cfg, tok, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    cfg = dataclasses.replace(cfgs["mistral"], mtp_depth=2, zero_init_out=True, window_warmup_steps=7)
    params = jax.tree.map(np.asarray, init(cfg, jax.random.key(1, impl="rbg")))
    lines = []
    export_model(params, cfg, tok, tmp_path / "hf", log=lines.append)
    assert len(lines) == 1 and "dropped the 2 multi-token-prediction module(s)" in lines[0]
    back = load_hf(tmp_path / "hf")
    assert back.cfg == dataclasses.replace(cfg, mtp_depth=0)
    assert_same_params(back.params, {k: v for k, v in params.items() if k != "mtp"})
