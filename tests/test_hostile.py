"""Hostile input, one test per defect found by probing the command line as a careless user and as an attacker would:
every refusal is one line and leaves the run directory (or --out) exactly as it was (hashed before and after);
files from outside — checkpoint directories, chat templates (tests/test_chat_templates.py), JSON of every kind,
token shards, mixtures — never reach outside their directory and have bounded cost."""

import errno
import json
import os
import shutil
import struct

import numpy as np
import pytest

from helpers import TINY_CFG, cli_in_process, snapshot, tiny_cfg
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError, DataError
from mlx_llm.settings import JsonProblem, parse_json

TINY_MODEL = ("--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
              "--set", "model.n_kv_heads=1", "--set", "model.d_head=8", "--set", "model.d_ff=32",
              "--set", "model.max_seq_len=64", "--seq-len", 16, "--batch-size", 2, "--no-progress",
              "--sample-tokens", 2, "--warmup-steps", 1)
TINY_FLAGS = TINY_MODEL + ("--steps", 2)


def refused(*args, code=2) -> str:
    """The one line of a command that must refuse (status ``code``)."""
    proc = cli_in_process(*args)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mlx-llm")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    rng = np.random.default_rng(0)
    path.write_text("\n".join(" ".join(rng.choice(["def", "x", "return", "(", ")"], 10)) for _ in range(400)))
    return path


# ----- the command line ------------------------------------------------------------------------------------------
def test_every_help_answers(capsys):
    """`mlx-llm rl --help` crashed (an empty mutually exclusive group); every subcommand's help now prints."""
    from mlx_llm.cli.parser import build_parser, subcommands

    for name in subcommands(build_parser()):
        proc = cli_in_process(name, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: mlx-llm {name}"), (name, proc.stderr)
    assert "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Mamba, Gemma 2 or Gemma 3" in " ".join(cli_in_process("--help").stdout.split())


@pytest.mark.parametrize("args, message", [
    (("--seed", 2**63), r"TrainConfig.seed = 9223372036854775808 is invalid: it must be an integer >= 0 and ≤ "),
    (("--set", f"train.seed={2**64}"), r"TrainConfig.seed = 18446744073709551616 is invalid"),
    (("--target-flops", "1e30"), r"--target-flops 1e\+30 .*steps, more than the 2,147,483,647 a run's step counter "),
    (("--tokens-per-param", "1e12"), r"--tokens-per-param 1e\+12 .*more than the 2,147,483,647"),
    (("--schedule", "cosine", "--decay-fraction", "0.3"), r"decay_fraction = 0.3 shape\(s\) the wsd decay, but "
                                                          r"schedule = 'cosine' has none"),
    (("--profile-steps", "5:2"), r"--profile-steps 5:2 starts after the run's last step \(2\)"),
    (("--time-budget", "1e12"), r"time budget of 1e\+12 s gives .* more than the 2,147,483,647"),
])
def test_numbers_out_of_range_are_one_line(tmp_path, text_file, args, message):
    import re

    out = tmp_path / "run"
    sized = {"--time-budget", "--target-flops", "--tokens-per-param"} & set(args)
    flags = TINY_MODEL if sized else TINY_FLAGS
    line = refused("train", "--out", out, "--data", text_file, "--tokenizer", "byte", *flags, *args)
    assert re.search(message, line), line
    assert not out.exists()


def test_generate_seed_and_empty_prompt(tmp_path):
    """--seed ≥ 2⁶³ and an empty prompt on a tokenizer without BOS: one line each, in words (no internal names)."""
    import jax

    from mlx_llm import init_params
    from mlx_llm.data.tokenizer import IdTokenizer
    from mlx_llm.runs.load import write_checkpoint_run
    from mlx_llm.runs.record import RunRecord

    cfg = tiny_cfg()
    run = write_checkpoint_run(tmp_path / "run", cfg, TrainConfig(), RunRecord(kind="imported"), IdTokenizer(64),
                               init_params(cfg, jax.random.key(0)), 0)
    before = snapshot(run)
    assert "seed = 9223372036854775808 is invalid" in refused("generate", "--run", run, "--prompt", "1 2",
                                                             "--seed", 2**63)
    assert "--prompt is empty and this run's tokenizer has no BOS" in refused("generate", "--run", run, "--prompt", "")
    assert snapshot(run) == before


def test_compile_refuses_a_window_longer_than_the_model(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(TINY_CFG))
    line = refused("compile", "--config", tmp_path / "m.json", "--seq-len", 64, "--batch-size", 2)
    assert "seq_len = 64 is longer than the model's max_seq_len = 32" in line


def test_lm_eval_limits_are_checked_first(tmp_path):
    pytest.importorskip("lm_eval")
    from mlx_llm.eval import harness

    for kw, message in ((dict(limit=-1), r"--limit = -1 is invalid"), (dict(num_fewshot=-3), r"--num-fewshot = -3")):
        with pytest.raises(ConfigError, match=message):
            harness.evaluate_run(tmp_path / "no-run", "x", **kw)


# ----- refused runs leave nothing ---------------------------------------------------------------------------------
def write_llmc_header_only(path):
    path.write_bytes(struct.pack("<256i", 20240520, 1, 0, *([0] * 253)))
    return path


@pytest.mark.parametrize("make, message", [
    (lambda d: np.save(d / "empty.npy", np.zeros(0, np.uint16)) or d / "empty.npy",
     r"the train split holds 0 token\(s\): a training window needs seq_len \+ 1 = 17"),
    (lambda d: np.save(d / "ten.npy", np.arange(10, dtype=np.uint16)) or d / "ten.npy",
     r"seq_len = 16 is too long for a train split of 9 tokens"),
    (lambda d: write_llmc_header_only(d / "header.bin"), r"the train split holds 0 token\(s\)"),
])
def test_token_shards_too_short_write_nothing(tmp_path, make, message):
    import re

    data, out = make(tmp_path), tmp_path / "run"
    line = refused("train", "--out", out, "--data", data, "--vocab-size", 64, *TINY_FLAGS)
    assert re.search(message, line), line
    assert not out.exists()
    assert "--tokenizer byte encodes text" in refused("train", "--out", out, "--data", data, "--tokenizer", "byte",
                                                    *TINY_FLAGS)


def test_data_that_cannot_be_a_corpus_is_refused_before_the_run_exists(tmp_path, text_file):
    self_ref = tmp_path / "self.json"
    self_ref.write_text(json.dumps({"sources": [{"name": "a", "path": "self.json"}]}))
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"sources": [{"name": "a", "path": str(text_file)}], "note": 1}))
    out = tmp_path / "run"
    cases = [(("--data", self_ref), r"source 'a' is a mixture file"),
             (("--data", extra), r"unknown key\(s\) \['note'\]; a mixture file holds only 'sources'"),
             (("--data", f"a={text_file}:1e308", f"b={text_file}:1e308"), r"sum to inf"),
             (("--data", f"a={text_file}:abc"), r"the weight 'abc' of source 'a' is not a number"),
             (("--data", text_file, "--text-field", "body"), r"--text-field 'body' names the text field of JSONL")]
    import re

    for args, message in cases:
        line = refused("train", "--out", out, "--tokenizer", "byte", *TINY_FLAGS, *args)
        assert re.search(message, line), (args, line)
        assert not out.exists()


@pytest.mark.slow
def test_a_run_that_diverges_before_its_first_checkpoint_leaves_nothing(tmp_path, text_file):
    """The chosen rule: a new run that fails before any checkpoint (here: it diverges) is removed, so the same
    command with the mistake fixed runs into the same --out without --resume; an empty --out it was given stays
    as it was (hashed)."""
    out = tmp_path / "run"
    flags = ("train", "--out", out, "--data", text_file, "--tokenizer", "byte", *TINY_FLAGS, "--steps", 6,
             "--checkpoint-interval", 6)
    line = refused(*flags, "--lr", 1e9)
    assert "training diverged" in line and "the run had no checkpoint, so nothing of it was kept" in line
    assert not out.exists()
    out.mkdir()
    before = snapshot(out)
    refused(*flags, "--lr", 1e9)
    assert snapshot(out) == before == {}
    assert cli_in_process(*flags, "--lr", 1e-3).returncode == 0
    assert (out / "checkpoints" / "6").is_dir()


# ----- checkpoint directories from outside ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint directory as `mlx-llm export` writes it (no transformers needed)."""
    import jax

    from mlx_llm import init_params
    from mlx_llm.data.tokenizer import ByteTokenizer
    from mlx_llm.interop.hf import export_model

    tok = ByteTokenizer()
    cfg = ModelConfig(**{**TINY_CFG, "vocab_size": tok.vocab_size})
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    return export_model(params, cfg, tok, tmp_path_factory.mktemp("hf") / "llama")


def edited(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def sharded(names):
    def edit(d):
        (d / "model.safetensors").rename(d / "shard.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "shard.safetensors", **names}}))
    return edit


def retensored(change):
    def edit(d):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def test_a_checkpoint_directory_cannot_reach_outside_itself(hf_dir, tmp_path):
    from mlx_llm.interop.hf import import_hf

    outside = tmp_path / "outside.safetensors"
    shutil.copy(hf_dir / "model.safetensors", outside)
    cases = [
        (sharded({"model.norm.weight": "../../../../etc/passwd"}), r"names '../../../../etc/passwd', which is outside"),
        (sharded({"model.norm.weight": str(outside)}), r"which is outside .*a checkpoint directory's files must lie"),
        (lambda d: (d / "model.safetensors").unlink() or (d / "model.safetensors").symlink_to(outside),
         r"names 'model.safetensors', which is outside"),
        (sharded({"model.norm.weight": ["a"]}), r"its weight_map must be an object mapping tensor names to shard"),
        (sharded({"model.norm.weight": ""}), r"names '', not a file name"),
    ]
    secret = tmp_path / "secret.json"
    secret.write_text("{}")

    def linked(name):  # a fixed file name of the directory, a link to a file outside it
        return lambda d: ((d / name).unlink(missing_ok=True), (d / name).symlink_to(secret))

    cases += [(linked(name), rf"names '{name}', which is outside")
              for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    for k, (edit, message) in enumerate(cases):
        src = edited(hf_dir, tmp_path / f"hf{k}", edit)
        with pytest.raises((CheckpointError, DataError), match=message) as info:
            import_hf(src, tmp_path / "run")
        assert "\n" not in str(info.value) and not (tmp_path / "run").exists()


def test_imported_weights_must_be_finite_floats(hf_dir, tmp_path):
    from mlx_llm.interop.hf import import_hf

    name = "model.layers.0.self_attn.q_proj.weight"

    def nan(t):
        t[name] = np.full_like(t[name], np.nan)

    cases = [(nan, rf"tensor '{name}' holds 256 non-finite value\(s\)"),
             (lambda t: t.update({name: t[name].astype(np.int8)}), rf"tensor '{name}' is int8, not a floating type"),
             (lambda t: t.update({name: t[name] > 0}), rf"tensor '{name}' is bool, not a floating type"),
             (lambda t: t.update({name: t[name].astype(np.complex64)}), r"is complex64, not a floating type")]
    for k, (change, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            import_hf(edited(hf_dir, tmp_path / f"hf{k}", retensored(change)), tmp_path / "run")
        assert not (tmp_path / "run").exists()
    half = edited(hf_dir, tmp_path / "half", retensored(lambda t: t.update({k: v.astype(np.float16)
                                                                             for k, v in t.items()})))
    assert import_hf(half, tmp_path / "ok").is_dir()  # float16 (and bfloat16, float64) are read as float32


@pytest.mark.parametrize("config, message", [
    ({"rope_parameters": "linear"}, r"rope_parameters = 'linear' is invalid: it must be an object"),
    ({"max_position_embeddings": 10**12}, r"max_seq_len = 1000000000000 is invalid"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings = 'yes' must be true or false"),
    ({"max_position_embeddings": 1e12}, r"max_seq_len = 1000000000000.0 is invalid"),
    ({"hidden_size": "64"}, r"gives no valid mlx_llm model: ModelConfig.d_model = '64' is invalid"),
    ({"num_attention_heads": 4, "head_dim": None, "hidden_size": [64]},
     r"a field of the LlamaForCausalLM config has a value of the wrong kind or range"),
    ({"__raw__": '{"vocab_size": ' + "9" * 5000 + "}"},
     r"cannot be read as JSON: an integer of 5,000 digits \(at most 100 are read\) \(line 1\)"),
    ({"__raw__": "[" * 100_000}, r"cannot be read as JSON: nested too deeply"),
])
def test_hf_config_values_are_checked(hf_dir, tmp_path, config, message):
    from mlx_llm.interop.hf import import_hf

    def edit(d):
        if "__raw__" in config:
            (d / "config.json").write_text(config["__raw__"])
            return
        obj = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**obj, **config}))

    with pytest.raises((ConfigError, CheckpointError), match=message) as info:
        import_hf(edited(hf_dir, tmp_path / "hf", edit), tmp_path / "run")
    assert "\n" not in str(info.value) and not (tmp_path / "run").exists()


def test_export_and_import_onto_a_full_disk_leave_nothing(hf_dir, tmp_path, monkeypatch):
    """A disk with too little room is refused before anything is written; a write that fails half-way (ENOSPC
    from the writer) leaves nothing either: one line, status 1."""
    from mlx_llm.interop import hf
    from mlx_llm.runs import rundir

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    line = refused("import", "--from", hf_dir, "--out", tmp_path / "imp", code=1)
    assert "needs about" in line and "has 0.0 MB free: nothing was written" in line
    monkeypatch.undo()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    run = hf.import_hf(hf_dir, tmp_path / "run")
    monkeypatch.setattr("safetensors.numpy.save_file", full)
    line = refused("export", "--run", run, "--to", tmp_path / "exp", code=1)
    assert line.endswith("no space left on device writing " + str(tmp_path / "exp") + ": nothing was written there; "
                         "free some space and run the same command again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"] or "exp" not in os.listdir(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mlx-partial-")]


def test_a_stale_partial_directory_is_removed_by_the_next_writer(hf_dir, tmp_path):
    from mlx_llm.runs.rundir import PARTIAL, _partial_name, new_dir

    target = tmp_path / ("x" * 245)  # a valid name whose temporary sibling must still fit NAME_MAX
    dead = tmp_path / _partial_name(target, 2**22 + 12345)  # a pid no process has here
    dead.mkdir()
    with new_dir(target) as tmp:
        (tmp / "f").write_text("ok")
    assert (target / "f").read_text() == "ok" and not dead.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(PARTIAL)]


def test_export_of_a_token_id_run_is_refused(tmp_path):
    from mlx_llm.data.tokenizer import IdTokenizer
    from mlx_llm.runs.record import RunRecord, write_run

    run = tmp_path / "ids"
    write_run(run, tiny_cfg(), TrainConfig(), RunRecord(kind="pretrain"))
    IdTokenizer(64).save(run)
    before = snapshot(run)
    line = refused("export", "--run", run, "--to", tmp_path / "hf")
    assert "trained on token ids whose tokenizer it does not hold" in line
    assert snapshot(run) == before and not (tmp_path / "hf").exists()


# ----- JSON from outside --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("[" * 100_000, r"^f.json:1: nested too deeply"),
    ('{"v": ' + "9" * 5000 + "}", r"^f.json:1: an integer of 5,000 digits"),
    ('{"x": "\\ud800"}', r"^f.json: the string at /x holds a lone UTF-16 surrogate"),
    ('{\n"a": [1,\n2,,]}', r"^f.json:3: not valid JSON"),
])
def test_json_from_outside_has_bounded_cost(text, message):
    with pytest.raises(JsonProblem, match=message):
        parse_json(text, "f.json")
    assert parse_json('{"x": "\\ud83d\\ude00"}', "f.json") == {"x": "\U0001F600"}  # a surrogate pair is a character


def test_hostile_jsonl_is_one_line_in_pretraining_and_sft(tmp_path):
    from mlx_llm.data import text as text_lib
    from mlx_llm.data.chat import read_conversations
    from mlx_llm.data.templates import template_for
    from mlx_llm.data.tokenizer import ByteTokenizer

    conv = json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
    rows = ["[" * 100_000, '{"text": ' + "9" * 5000 + "}", '{"text": "\\ud800 x"}']
    for k, row in enumerate(rows):
        for kind, good in (("text", '{"text": "fine"}'), ("chat", conv)):
            path = tmp_path / f"{kind}{k}.jsonl"
            path.write_text((good + "\n") * 40 + row.replace('"text"', '"messages"' if kind == "chat" else '"text"')
                            + "\n")
            with pytest.raises(DataError, match=rf"{kind}{k}.jsonl:41: ") as info:
                if kind == "text":
                    text_lib.read_corpus(path)
                else:
                    read_conversations(path, ByteTokenizer(), template_for(ByteTokenizer()), 512)
            assert "\n" not in str(info.value)


# ----- reading regular files only ------------------------------------------------------------------------------------
def test_a_fifo_matched_by_a_glob_is_skipped_and_counted(tmp_path, caplog):
    from mlx_llm.data import text as text_lib

    for k in range(6):
        (tmp_path / f"d{k}.txt").write_text(f"document {k} " * 50)
    os.mkfifo(tmp_path / "pipe.txt")
    corpus = text_lib.read_corpus(str(tmp_path / "*.txt"))
    assert corpus.stats.not_regular_files == [str(tmp_path / "pipe.txt")]
