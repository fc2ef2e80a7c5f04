"""The generated CLI: every flag is a documented config field or a documented command option; a subcommand
has only the flags it honours; `mlx-llm --help` imports no jax; files honour the umask."""

import argparse
import dataclasses
import json
import os
from pathlib import Path

import pytest

from mlx_llm.cli import build_parser
from mlx_llm.cli import parser as parser_lib
from mlx_llm.errors import MLXLLMError
from mlx_llm.cli.flags import given
from mlx_llm.config import TrainConfig
from helpers import cli_in_process, python

REPO = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return parser_lib.subcommands(build_parser())


def test_every_flag_of_every_subcommand_has_help_text():
    subs = subcommands()
    assert set(subs) == {"train", "sft", "reward", "dpo", "rl", "eval", "compile", "eval-task", "chat",
                         "export-merged", "export", "import", "generate", "compare", "serve"}
    missing = [(name, a.option_strings) for name, p in subs.items() for a in p._actions
               if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert missing == []


def test_flags_are_the_config_fields():
    subs = subcommands()
    train_flags = {a.dest for a in subs["train"]._actions if a.dest.startswith("train.")}
    fields = {f"train.{f.name}" for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli", True)}
    assert train_flags == fields
    for kind in ("reward", "dpo", "rl", "sft"):  # every training command takes --mesh, --grad-accum, --remat
        dests = {a.dest for a in subs[kind]._actions}
        assert {"train.mesh", "train.grad_accum", "train.remat", "train.log_interval"} <= dests, kind
        assert "train.objective" not in dests  # preference and chat runs train next-token models
    assert "train.eval_tokens" not in {a.dest for a in subs["rl"]._actions}  # rl evaluates held-out examples
    assert "train.eval_tokens" in {a.dest for a in subs["dpo"]._actions}


def test_only_given_flags_reach_the_command():
    args = build_parser().parse_args(["dpo", "--out", "x", "--beta", "0.5", "--lora-rank", "2", "--mesh", "data=2"])
    assert given(args) == {"settings": {"beta": 0.5}, "lora": {"rank": 2}, "train": {"mesh": "data=2"}}
    args = build_parser().parse_args(["train", "--extensions", ".py, .md", "--loss-chunk", "auto"])
    assert given(args) == {"data": {"extensions": (".py", ".md")}, "train": {"loss_chunk": "auto"}}


def test_every_boolean_setting_has_an_off_flag():
    """A boolean setting whose default is on, or left to the config to resolve (dapo's dynamic sampling), is turned
    off by ``--no-<flag>``; the flag that is not given reaches nothing."""
    from mlx_llm.runs.configs import RLConfig

    parse = build_parser().parse_args
    assert given(parse(["rl", "--out", "x", "--no-dynamic-sampling"])) == {"settings": {"dynamic_sampling": False}}
    assert given(parse(["rl", "--out", "x", "--dynamic-sampling"])) == {"settings": {"dynamic_sampling": True}}
    assert given(parse(["train", "--no-skip-spikes"])) == {"train": {"skip_spikes": False}}
    assert RLConfig(task="arithmetic", algorithm="dapo").dynamic_sampling is True
    assert RLConfig(task="arithmetic", algorithm="dapo", dynamic_sampling=False).dynamic_sampling is False
    bools = [a for p in subcommands().values() for a in p._actions if isinstance(a, argparse.BooleanOptionalAction)]
    assert bools and all(a.option_strings[1] == "--no-" + a.option_strings[0][2:] for a in bools)


def test_help_shows_the_recipes_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: 640)" in out and "(default: 1024)" in out  # the main job's steps and vocabulary
    assert "(default: normuon)" in out and "(default: 0.01)" in out  # its optimizer and peak learning rate
    assert "(default: 27)" in out  # its warmup, scaled with its steps


def test_mlx_llm_help_imports_no_jax():
    code = ("import sys, contextlib, io\nimport mlx_llm.cli\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    mlx_llm.cli.main(['train', '--help'])\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    proc = python("-c", code, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"')) == []


def test_files_honour_the_umask(tmp_path):
    from mlx_llm.config import write_json_atomic
    from mlx_llm.data.tokenizer import ByteTokenizer

    old = os.umask(0o027)
    try:
        ByteTokenizer().save(tmp_path)
        write_json_atomic(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "tokenizer.json").st_mode & 0o777) == oct(0o640)
    assert oct(os.stat(tmp_path / "x.json").st_mode & 0o777) == oct(0o640)


@pytest.mark.parametrize("command, kept", [("eval", False), ("generate", False), ("chat", False), ("train", True),
                                           ("dpo", True)])
def test_ctrl_c_names_the_checkpoint_only_for_training_commands(monkeypatch, capsys, command, kept):
    from mlx_llm import cli
    from mlx_llm.cli import commands

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setitem(commands.COMMANDS, command, interrupted)
    argv = {"eval": ["eval", "--run", "r"], "generate": ["generate", "--run", "r", "--prompt", "x"],
            "chat": ["chat", "--run", "r"], "train": ["train"], "dpo": ["dpo", "--out", "o"]}[command]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlx-llm {command}: interrupted") and ("last checkpoint is kept" in err) == kept


@pytest.mark.parametrize("flags, message", [
    (["--clip", "0.3"], "RLConfig ['clip'] apply to the clipped algorithms ['grpo', 'dr_grpo', 'dapo', 'gspo', "
                        "'ppo'], not 'group'"),
    (["--algorithm", "ppo", "--epochs", "0"], "RLConfig.epochs = 0 is invalid: it must be an integer >= 1"),
    (["--algorithm", "ppo", "--value-coef", "-1"], "RLConfig.value_coef = -1.0 is invalid"),
])
def test_bad_ppo_settings_are_refused_in_one_line_before_anything_is_written(tmp_path, flags, message):
    proc = cli_in_process("rl", "--base", tmp_path / "base", "--task", "arithmetic", *flags, "--out", tmp_path / "o")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert message in proc.stderr and not (tmp_path / "o").exists()


def test_set_reaches_every_config_of_a_post_command():
    """``--set`` over a post-training command's configs: its settings under the kind's name, LoRA, the train
    config and the reporting options; the model comes from --base, so it has no model section."""
    from mlx_llm.cli import build_parser
    from mlx_llm.cli.flags import apply_sets, given

    args = build_parser().parse_args(["dpo", "--out", "x", "--set", "dpo.beta=0.25", "--set", "lora.rank=4",
                                      "--set", "train.steps=7", "--set", "run.tracker=tensorboard",
                                      "--set", "dpo.reference=none"])
    fields = apply_sets(given(args), args.sets, args.sections)
    assert fields["settings"] == {"beta": 0.25, "reference": None} and fields["lora"] == {"rank": 4}
    assert fields["train"] == {"steps": 7} and fields["run"] == {"tracker": ("tensorboard",)}
    args = build_parser().parse_args(["sft", "--out", "x", "--set", "model.d_model=8"])
    with pytest.raises(MLXLLMError, match="this command has no 'model' settings; its sections are train, sft, lora"):
        apply_sets(given(args), args.sets, args.sections)
