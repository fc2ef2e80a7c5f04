"""HF interop (mlx_llm/interop): export → transformers loads it and computes our logits and greedy tokens; the
tokenizer encodes like ours; import(export(x)) = x bit for bit; every refusal names its cause; the CLI.

Needs the ``hf`` extra (torch, transformers). Tiny float32 models; no network (HF_HUB_OFFLINE)."""

import json
import os
import re
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlx_llm import ModelConfig, forward, generate, init_params
from mlx_llm.config import TrainConfig, umask_mode
from mlx_llm.errors import CheckpointError, ConfigError, DataError
from mlx_llm.interop import export_model, export_run, import_hf, load_hf
from mlx_llm.layers import moe
from mlx_llm import lora as lora_lib
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.runs.configs import SFTConfig
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import BaseRef, RunRecord, open_run, write_run
from mlx_llm.train.checkpoint import Checkpoints
from mlx_llm.train.step import init_state, optimizer_for
from helpers import cli_in_process, snapshot

pytestmark = pytest.mark.slow  # torch + transformers, and a tiny run per architecture

LOGIT_TOL = 1e-4
TEXTS = ["", "hello world", "  two  spaces\n\ttab\r\nCRLF", "naïve café — 数学 🙂", "def f(x):\n    return x**2\n",
         "x = 12 + 30\n" * 3]
CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
          "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 20


def tiny_configs(v_bpe: int, v_byte: int) -> dict:
    """Each class with its own twists: GQA, head width ≠ d/H, RoPE interpolation (Llama); conv width 3, a Δ rank
    and the associative scan, untied (Mamba); one KV head, tied embeddings, a nonzero offset rate (Mixtral)."""
    return {
        "llama": ModelConfig(vocab_size=v_bpe, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=48,
                             rope_base=500.0, rope_scale=0.5, norm_eps=1e-5, max_seq_len=64),
        "mamba": ModelConfig(vocab_size=v_byte, d_model=32, n_layers=2, mixer_pattern=("mamba",),
                             ffn_pattern=("none",), ssm_state=8, ssm_conv=3, ssm_dt_rank=3, norm_eps=1e-5,
                             ssm_scan="associative", max_seq_len=64),
        "mixtral": ModelConfig(vocab_size=v_byte, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_head=8,
                               ffn_pattern=("moe",), n_experts=4, moe_top_k=2, moe_d_ff=24, router="softmax",
                               offset_rate=0.01, tie_embeddings=True, max_seq_len=64),
    }


def nontrivial(params: dict, seed: int) -> dict:
    """init_params (as numpy) with every gain, bias and SSM constant moved off its initial value (a swapped or
    dropped tensor then shows in the logits): norm gains 1 ± 0.3, conv/Δ biases and D random, A = −exp(A_log)
    spread over [0.5, 8], the router × 4 so tokens disagree on their experts."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(np.asarray, params)

    def noise(a, scale):
        return (a + scale * rng.standard_normal(a.shape)).astype(np.float32)

    blocks = dict(params["blocks"])
    for name in ("attn_norm", "ffn_norm", "ssm_norm", "conv_b", "D"):
        if name in blocks:
            blocks[name] = noise(blocks[name], 0.3)
    if "dt_bias" in blocks:
        blocks["dt_bias"] = noise(blocks["dt_bias"], 1.0)
        blocks["A_log"] = rng.uniform(np.log(0.5), np.log(8.0), blocks["A_log"].shape).astype(np.float32)
    if "router" in blocks:
        blocks["router"] = 4.0 * blocks["router"]
    return {**params, "blocks": blocks, "final_norm": noise(params["final_norm"], 0.3)}


# One compiled program per config, and XLA's own generator instead of threefry: the library's init_params, at a
# fraction of its eager compile time on 2 cores.
jit_init = jax.jit(init_params, static_argnums=0)


@pytest.fixture(scope="module")
def hf():
    """torch and transformers, imported once (seconds)."""
    import torch
    import transformers

    torch.manual_seed(0)
    return torch, transformers


@pytest.fixture(scope="module")
def tokenizers():
    return {"bpe": tok_lib.train_bpe(CORPUS, 300), "byte": tok_lib.ByteTokenizer()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizers):
    """arch → (cfg, params (numpy), tokenizer, exported directory)."""
    root = tmp_path_factory.mktemp("hf")
    cfgs = tiny_configs(tokenizers["bpe"].vocab_size, tokenizers["byte"].vocab_size)
    out = {}
    for i, (arch, cfg) in enumerate(cfgs.items()):
        tok = tokenizers["bpe" if arch == "llama" else "byte"]
        params = nontrivial(jit_init(cfg, jax.random.key(i, impl="rbg")), seed=10 + i)
        out[arch] = (cfg, params, tok, export_model(params, cfg, tok, root / arch))
    return out


@pytest.fixture(scope="module")
def hf_models(hf, exported):
    _, transformers = hf
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(d) for arch, (_, _, _, d) in exported.items()}


def hf_logits(hf, model, ids) -> np.ndarray:
    torch, _ = hf
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


# ----- transformers computes our model -------------------------------------------------------------------
@pytest.mark.parametrize("arch,hf_class", [("llama", "LlamaForCausalLM"), ("mamba", "MambaForCausalLM"),
                                           ("mixtral", "MixtralForCausalLM")])
def test_transformers_logits_equal_ours(hf, exported, hf_models, arch, hf_class):
    cfg, params, _, _ = exported[arch]
    model = hf_models[arch]
    assert type(model).__name__ == hf_class and not model.training
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 24))
    ours = np.asarray(forward(params, ids, cfg))
    theirs = hf_logits(hf, model, ids)
    diff = float(np.abs(ours - theirs).max())
    print(f"{arch}: max |logit difference| {diff:.3g} (logit scale {np.abs(ours).max():.3g})")
    assert theirs.dtype == np.float32 and diff <= LOGIT_TOL


@pytest.mark.parametrize("arch", ["llama", "mamba", "mixtral"])
def test_greedy_generation_equal(hf, exported, hf_models, arch):
    torch, _ = hf
    cfg, params, tok, _ = exported[arch]
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6))
    n = 12
    ours = generate(params, cfg, prompt, n, eos_id=tok.eos_id, pad_id=tok.pad_id)  # temperature None: greedy
    with torch.no_grad():
        out = hf_models[arch].generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                                       max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id,
                                       pad_token_id=tok.pad_id)
    theirs = out[:, prompt.shape[1]:].numpy()
    ours_t = np.asarray(ours.tokens)
    assert theirs.shape[1] >= 1
    np.testing.assert_array_equal(ours_t[:, :theirs.shape[1]], theirs)
    assert (ours_t[:, theirs.shape[1]:] == tok.pad_id).all()  # transformers stops once every row hit EOS


def test_mixtral_routing_is_ours(hf, exported, hf_models):
    """Mixtral: softmax over all X logits, top-k, renormalise; ours: top-k of the logits, softmax over the k
    selected. Same experts (softmax is monotone) and the same weights: p_e/Σ_S p_j = e^{r_e}/Σ_S e^{r_j}."""
    torch, _ = hf
    cfg, params, _, _ = exported["mixtral"]
    h = np.random.default_rng(3).normal(size=(64, cfg.d_model)).astype(np.float32)
    for layer in range(cfg.n_layers):
        ids, weights = moe.route(h @ params["blocks"]["router"][layer], params["blocks"]["router_offset"][layer],
                                 cfg.moe_top_k, router="softmax")
        with torch.no_grad():
            _, scores, indices = hf_models["mixtral"].model.layers[layer].mlp.gate(torch.tensor(h))
        np.testing.assert_array_equal(np.asarray(ids), indices.numpy())
        np.testing.assert_allclose(np.asarray(weights), scores.numpy(), atol=1e-6)
        assert len({tuple(sorted(r)) for r in np.asarray(ids).tolist()}) >= 4  # routing is not trivial
    r = np.random.default_rng(4).normal(size=(100, 8)) * 3  # the identity, in float64
    top = np.argsort(-r, axis=1)[:, :3]
    p = np.exp(r) / np.exp(r).sum(1, keepdims=True)
    p_top = np.take_along_axis(p, top, 1)
    r_top = np.take_along_axis(r, top, 1)
    np.testing.assert_allclose(p_top / p_top.sum(1, keepdims=True),
                               np.exp(r_top) / np.exp(r_top).sum(1, keepdims=True), rtol=1e-13)


@pytest.mark.parametrize("kind,arch", [("bpe", "llama"), ("byte", "mamba")])
def test_tokenizer_encodes_like_ours(hf, exported, kind, arch):
    _, transformers = hf
    _, _, tok, out = exported[arch]
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = tok.encode(text).tolist()
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert theirs(text)["input_ids"] == [tok.bos_id] + ids  # BOS first, as our runs prompt
        assert theirs.decode(ids) == tok.decode(ids)
    marked = "<|user|>hi<|end|><|assistant|>"
    assert theirs(marked, add_special_tokens=False)["input_ids"] == tok.encode(marked, parse_special=True).tolist()
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    back = load_hf(out).tok
    assert type(back) is type(tok) and back.fingerprint() == tok.fingerprint()


# ----- import(export(x)) = x ---------------------------------------------------------------------------------
def assert_same_params(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype == np.float32 and x.shape == y.shape
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))  # bit for bit


@pytest.mark.parametrize("arch", ["llama", "mamba", "mixtral"])
def test_import_of_export_is_bitwise_identity(exported, tmp_path, arch):
    cfg, params, tok, out = exported[arch]
    back = load_hf(out)
    assert back.cfg == cfg and back.cfg.to_dict() == cfg.to_dict()
    assert_same_params(back.params, params)
    run = import_hf(out, tmp_path / "run")
    opened = open_run(run)
    run_cfg = opened.cfg
    assert run_cfg == cfg and opened.record.provenance["imported"]["class"] == back.hf_class
    assert_same_params(load_params(run), params)
    again = export_run(run, tmp_path / "again")  # and out again: the same tensors, byte for byte
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    for written in (again / "model.safetensors", run / "tokenizer.json"):  # the umask's mode, not 0600
        assert os.stat(written).st_mode & 0o777 == umask_mode(), written


@pytest.mark.parametrize("arch", ["llama", "mamba", "mixtral"])
def test_checkpoint_saved_by_transformers_imports(exported, hf_models, tmp_path, arch):
    """What transformers itself writes (save_pretrained) imports to the same model."""
    cfg, params, _, out = exported[arch]
    hf_models[arch].save_pretrained(tmp_path / "saved")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, tmp_path / "saved" / name)
    back = load_hf(tmp_path / "saved")
    assert back.cfg == cfg
    assert_same_params(back.params, params)


def test_fused_mixtral_layout_imports(exported, tmp_path):
    """transformers 5's in-memory Mixtral layout: experts.gate_up_proj (X, 2m, d), experts.down_proj (X, d, m)."""
    cfg, params, _, out = exported["mixtral"]

    def fuse(t):
        for l in range(cfg.n_layers):
            p = f"model.layers.{l}.block_sparse_moe."
            w = [[t.pop(f"{p}experts.{e}.{k}.weight") for e in range(cfg.n_experts)] for k in ("w1", "w3", "w2")]
            t[f"model.layers.{l}.mlp.experts.gate_up_proj"] = np.concatenate([np.stack(w[0]), np.stack(w[1])], 1)
            t[f"model.layers.{l}.mlp.experts.down_proj"] = np.stack(w[2])
            t[f"model.layers.{l}.mlp.gate.weight"] = t.pop(p + "gate.weight")

    assert_same_params(load_hf(_retensor(out, tmp_path / "fused", fuse)).params, params)


def test_sharded_checkpoint_imports(exported, tmp_path):
    cfg, params, _, out = exported["llama"]
    sharded = tmp_path / "sharded"
    shutil.copytree(out, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(sharded / f"model-{k + 1:05d}-of-00002.safetensors"))
        weight_map |= {n: f"model-{k + 1:05d}-of-00002.safetensors" for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same_params(load_hf(sharded).params, params)


# ----- runs: LoRA merged, reward and diffusion refused --------------------------------------------------------
@pytest.fixture(scope="module")
def llama_run(exported, tmp_path_factory):
    return import_hf(exported["llama"][3], tmp_path_factory.mktemp("runs") / "llama")


def test_lora_run_exports_merged(hf, hf_models, llama_run, tmp_path):
    _, transformers = hf
    opened = open_run(llama_run)
    cfg, tcfg = opened.cfg, opened.tcfg
    base = load_params(llama_run)
    lcfg = lora_lib.LoRAConfig(rank=2, alpha=4.0, targets=("wq", "w_up"))
    rng = np.random.default_rng(5)  # B = 0 at init: make both factors random so the merge changes the model
    adapters = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(np.float32),
                            lora_lib.init(base, lcfg, jax.random.key(5, impl="rbg")))
    run = tmp_path / "lora"
    write_run(run, cfg, tcfg, RunRecord(kind="sft", data=opened.record.data, base=BaseRef(str(llama_run), 0),
                                        lora=lcfg, template=ChatTemplate().to_dict(),
                                        settings=SFTConfig(data=str(llama_run / "conversations.jsonl"))))
    shutil.copy(llama_run / "tokenizer.json", run / "tokenizer.json")
    ckpts = Checkpoints(run)
    ckpts.save(0, init_state(cfg, tcfg, optimizer_for(tcfg), adapters))
    ckpts.close()
    merged = lora_lib.merge(base, adapters, lcfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(export_run(run, tmp_path / "out"))
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 16))
    ours = np.asarray(forward(merged, ids, cfg))
    assert np.abs(ours - hf_logits(hf, model, ids)).max() <= LOGIT_TOL
    assert np.abs(ours - hf_logits(hf, hf_models["llama"], ids)).max() > 1e-3  # the adapters did change it


def _edit_run(src: Path, dst: Path, file: str, edit) -> Path:
    shutil.copytree(src, dst)
    obj = json.loads((dst / file).read_text())
    edit(obj)
    (dst / file).write_text(json.dumps(obj))
    return dst


def test_reward_diffusion_and_untrained_runs_refused(llama_run, tmp_path):
    reward = _edit_run(llama_run, tmp_path / "reward", "run.json", lambda o: o.update(
        kind="reward", base={"run": str(llama_run), "step": 0}, settings={"task": "arithmetic"}))
    with pytest.raises(ConfigError, match="reward model"):
        export_run(reward, tmp_path / "out1")
    diffusion = _edit_run(llama_run, tmp_path / "diff", "train_config.json", lambda o: o.update(objective="diffusion"))
    with pytest.raises(ConfigError, match="diffusion"):
        export_run(diffusion, tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
    empty = _copy_without(llama_run, tmp_path / "untrained", "checkpoints")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        export_run(empty, tmp_path / "out3")
    assert not (empty / "checkpoints").exists() and not (tmp_path / "out3").exists()


# ----- export refusals: what transformers cannot express --------------------------------------------------
BASE = dict(vocab_size=263, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, max_seq_len=64)
MOE = dict(BASE, ffn_pattern=("moe",), n_experts=4, moe_top_k=2, moe_d_ff=16)
REFUSED = [
    (dict(BASE, d_ff=32, mixer_pattern=("mamba", "attn")), r"hybrid or mixed stacks"),
    (dict(BASE, d_ff=32, ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2, moe_d_ff=16), r"hybrid or mixed"),
    (dict(BASE, mixer_pattern=("mamba",), ffn_pattern=("swiglu",), d_ff=32), r"no class for this stack"),
    (dict(MOE, router="sigmoid"), r"router = 'sigmoid'.*softmax"),
    (dict(MOE, router="softmax", n_shared_experts=1), r"shared .*experts"),
    (dict(BASE, d_ff=32, causal=False), r"bidirectional"),
    (dict(BASE, d_ff=32, d_model=30), r"multiple of num_attention_heads"),
    (dict(BASE, d_ff=32, rope_scale=0.11), r"rope_scale = 0.11"),
]


@pytest.mark.parametrize("fields,message", REFUSED)
def test_export_refuses_what_transformers_cannot_express(tokenizers, tmp_path, fields, message):
    cfg = ModelConfig(**fields)
    with pytest.raises(ConfigError, match=message):
        export_model(None, cfg, tokenizers["byte"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_nonzero_offsets_refused(exported, tmp_path):
    cfg, params, tok, _ = exported["mixtral"]
    offsets = np.array(params["blocks"]["router_offset"])
    offsets[1, 2] = 0.01
    bad = {**params, "blocks": {**params["blocks"], "router_offset": offsets}}
    with pytest.raises(ConfigError, match=r"1 balancing offset.*layer 1 expert 2: 0\.01"):
        export_model(bad, cfg, tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_never_overwrites(exported, tmp_path):
    cfg, params, tok, _ = exported["llama"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_model(params, cfg, tok, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


# ----- import refusals -------------------------------------------------------------------------------------
def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def _retensor(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_import_refusals_write_nothing(exported, tmp_path):
    out = exported["llama"][3]
    foreign = _edit_run(out, tmp_path / "gpt2", "config.json",
                        lambda o: o.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    pickled = _copy_without(out, tmp_path / "pickled", "model.safetensors")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    missing = _retensor(out, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    biased = _retensor(out, tmp_path / "biased", lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    cases = [
        (foreign, ConfigError, r"'GPT2LMHeadModel'.*no mlx_llm equivalent"),
        (pickled, CheckpointError, r"pytorch_model.bin.*safetensors only"),
        (_copy_without(out, tmp_path / "noweights", "model.safetensors"), CheckpointError, r"no model.safetensors"),
        (_copy_without(out, tmp_path / "noconfig", "config.json"), CheckpointError, r"no config.json"),
        (_copy_without(out, tmp_path / "notok", "tokenizer.json"), DataError, r"no tokenizer.json"),
        (missing, CheckpointError, r"'model.layers.1.mlp.up_proj.weight' is missing"),
        (biased, CheckpointError, r"q_proj.bias.*not a plain llama"),
        (tmp_path / "nowhere", CheckpointError, r"not a directory"),
    ]
    for src, error, message in cases:
        with pytest.raises(error, match=message):
            import_hf(src, tmp_path / "run")
        assert not (tmp_path / "run").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        import_hf(out, tmp_path / "full")


def test_an_export_records_no_local_absolute_path(exported, tmp_path):
    """config.json's provenance held the run's absolute directory and its data settings with the corpus's, the
    mixture sources' and a tokenizer file's absolute paths: a published export said where it was trained. Now
    no file the export writes holds the private directory; the run, corpus and sources are there by name, and
    an import takes the data settings but no location (the default corpus)."""
    from mlx_llm.runs.configs import DataSpec
    from mlx_llm.runs.load import write_checkpoint_run

    cfg, params, tok, _ = exported["llama"]
    private = (tmp_path / "private").resolve()
    for d in ("corpus", "code", "prose"):
        (private / d).mkdir(parents=True)
    specs = {"single": DataSpec(path=str(private / "corpus"), tokenizer=str(private / "tok" / "tokenizer.json"),
                                val_percent=10.0, extensions=(".py",), fingerprint="ab" * 32),
             "mixture": DataSpec(mixture=(f"code={private / 'code'}:1.0", f"prose={private / 'prose'}:3.0"))}
    for name, spec in specs.items():
        run = write_checkpoint_run(private / name, cfg, TrainConfig(seq_len=32), RunRecord(kind="pretrain", data=spec),
                                   tok, params, 1)
        proc = cli_in_process("export", "--run", run, "--to", tmp_path / f"hf_{name}")
        assert proc.returncode == 0, proc.stderr
        files = sorted((tmp_path / f"hf_{name}").iterdir())
        assert len(files) == 5 and all(str(private).encode() not in f.read_bytes() for f in files)
        block = json.loads((tmp_path / f"hf_{name}" / "config.json").read_text())["mlx_llm"]["provenance"]
        assert block["run"] == name and block["step"] == 1
        back = open_run(import_hf(tmp_path / f"hf_{name}", tmp_path / f"back_{name}"))
        assert back.record.provenance["imported"]["exported_from"] == name
        assert back.record.data.path is None and back.record.data.mixture == ()
        assert back.record.data.fingerprint is None  # the exporter's corpus's, not the default corpus it names
        assert back.record.data.val_percent == spec.val_percent and back.record.data.extensions == spec.extensions
    single = json.loads((tmp_path / "hf_single" / "config.json").read_text())["mlx_llm"]["provenance"]["data"]
    assert (single["name"], single["tokenizer"], single["val_percent"]) == ("corpus", "tokenizer.json", 10.0)
    mixture = json.loads((tmp_path / "hf_mixture" / "config.json").read_text())["mlx_llm"]["provenance"]["data"]
    assert mixture["sources"] == ["code=code:1.0", "prose=prose:3.0"] and "name" not in mixture


def test_float64_weights_beyond_float32_are_refused_as_not_fitting(exported, tmp_path):
    """A float64 tensor that is finite in the file but overflows float32 (import's dtype) was called "non-finite …
    damaged"; it is refused saying what it is: the tensor, its largest |value|, the dtype it does not fit. NaN in
    the file is still damage. One line, nothing written, the source unchanged."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def wide(t, value):
        t.update({k: v.astype(np.float64) for k, v in t.items()})
        t[name][3, 5] = value

    cases = [(1e39, rf"tensor '{name}' \(float64\) holds values up to \|x\| = 1e\+39, which do not fit float32 "
                    rf"\(the dtype import reads weights as; its largest is 3.403e\+38\): nothing was imported$"),
             (-np.inf, rf"tensor '{name}' holds 1 non-finite value\(s\) \(NaN or ±inf\): the checkpoint is damaged")]
    for k, (value, message) in enumerate(cases):
        src = _retensor(exported["llama"][3], tmp_path / f"src{k}", lambda t: wide(t, value))
        before = snapshot(src)
        proc = cli_in_process("import", "--from", src, "--out", tmp_path / "run")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert re.search(message, proc.stderr.strip()), proc.stderr
        assert snapshot(src) == before and not (tmp_path / "run").exists()
    fits = _retensor(exported["llama"][3], tmp_path / "fits", lambda t: wide(t, 3e38))  # within float32: imports
    assert load_hf(fits).params["blocks"]["wq"].reshape(-1).max() == np.float32(3e38)


# ----- the CLI ------------------------------------------------------------------------------------------------
def test_cli_export_then_import_then_generate(llama_run, tmp_path):
    proc = cli_in_process("export", "--run", llama_run, "--to", tmp_path / "hf")
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    proc = cli_in_process("import", "--from", tmp_path / "hf", "--out", tmp_path / "run")
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    records = []
    for run in (llama_run, tmp_path / "run"):
        proc = cli_in_process("generate", "--run", run, "--prompt", "def ", "--max-new-tokens", 5, "--json")
        assert proc.returncode == 0, proc.stderr
        records.append(json.loads(proc.stdout)["continuation_ids"])
    assert records[0] == records[1]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["provenance"]["imported"]["exported_from"] == llama_run.name  # a name: exports hold no local path


def test_cli_refusals_are_one_line(exported, tmp_path):
    cfg = ModelConfig(**dict(BASE, d_ff=32, mixer_pattern=("mamba", "attn")))
    hybrid = tmp_path / "hybrid"
    write_run(hybrid, cfg, TrainConfig(), RunRecord(kind="pretrain"))
    proc = cli_in_process("export", "--run", hybrid, "--to", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "mlx-llm export: error:" in proc.stderr and "hybrid" in proc.stderr and not (tmp_path / "out").exists()
    pickled = _copy_without(exported["mamba"][3], tmp_path / "pickled", "model.safetensors")
    (pickled / "pytorch_model.bin").write_bytes(b"")
    proc = cli_in_process("import", "--from", pickled, "--out", tmp_path / "run")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "safetensors" in proc.stderr
    assert not (tmp_path / "run").exists()
