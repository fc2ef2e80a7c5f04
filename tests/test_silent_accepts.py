"""Settings that were accepted silently and did something senseless (issue 51): each is now refused in one line
naming the field and what is valid, before anything is written (the directory hashed before and after) and, for
``rl --top-k``, before anything is compiled."""

import re

import pytest

from helpers import cli_in_process, snapshot, tiny_cfg
from test_hostile import text_file  # noqa: F401  (the fixture: a small text corpus)
from mlx_llm.config import MUP_WIDER_MAX, SOFTCAP_MIN, TrainConfig, check_mtp_window
from mlx_llm.errors import ConfigError

TINY = ("--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--set", "model.d_head=8", "--set", "model.d_ff=32",
        "--set", "model.max_seq_len=64", "--seq-len", 16, "--batch-size", 2, "--no-progress",
        "--sample-tokens", 2, "--warmup-steps", 1, "--steps", 2, "--tokenizer", "byte")


def refused(*args) -> str:
    """The one line of a command that must refuse with status 2."""
    proc = cli_in_process(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("field, value, what", [("logit_softcap", 1e-30, "output logit"),
                                                ("attn_softcap", 0.5, "attention score")])
def test_a_soft_cap_below_one_is_refused(field, value, what):
    """A cap of 1e-30 squeezed every logit to ~0: the model could only predict the uniform distribution."""
    with pytest.raises(ConfigError, match=rf"ModelConfig.{field} = {value!r} is invalid: a soft cap c confines every "
                                          rf"{what} to \(-c, c\), so below 1 it flattens"):
        tiny_cfg(**{field: value})
    assert getattr(tiny_cfg(**{field: SOFTCAP_MIN}), field) == 1.0  # the floor itself is a cap


def test_a_mup_base_far_wider_than_the_model_is_refused():
    """mup_base_width = 2^31 − 1 made m = d/d₀ ≈ 7e-9, so the logits were multiplied by ~1.3e8."""
    with pytest.raises(ConfigError, match=r"ModelConfig.mup_base_width = 2147483647 is invalid: .* at most 16 x "
                                          r"d_model = 256"):
        tiny_cfg(parametrization="mup", mup_base_width=2**31 - 1)
    with pytest.raises(ConfigError, match=r"mup_base_head_width = 65 is invalid: .* at most 16 x d_head = 64"):
        tiny_cfg(parametrization="mup", mup_base_width=64, mup_base_head_width=65)
    cfg = tiny_cfg(parametrization="mup", mup_base_width=MUP_WIDER_MAX * 16, mup_base_head_width=64)
    assert cfg.width_mult == 1 / 16


def test_an_mtp_depth_as_deep_as_the_window_is_refused():
    check_mtp_window(tiny_cfg(mtp_depth=3), TrainConfig(seq_len=4))  # module 3 predicts position t + 4: fits
    with pytest.raises(ConfigError, match=r"mtp_depth = 4 needs training windows longer than itself .* but "
                                          r"seq_len = 4: raise --seq-len above 4, or lower model.mtp_depth below 4"):
        check_mtp_window(tiny_cfg(mtp_depth=4), TrainConfig(seq_len=4))


@pytest.mark.parametrize("flags, message", [
    (("--set", "model.logit_softcap=1e-30"), r"ModelConfig.logit_softcap = 1e-30 is invalid: a soft cap"),
    (("--set", "model.parametrization=mup", "--set", f"model.mup_base_width={2**31 - 1}"),
     r"ModelConfig.mup_base_width = 2147483647 is invalid"),
    (("--set", "model.mtp_depth=16"), r"mtp_depth = 16 needs training windows longer than itself"),
    pytest.param(("--profile-steps", "2:3"), r"--profile-steps 2:3 traces steps 2-4, past the run's last step "
                                             r"\(2\): give at most 1 steps from step 2",
                 marks=pytest.mark.slow),  # checked where the existing START check is: after the step compiles
], ids=["logit_softcap", "mup_base_width", "mtp_depth", "profile_steps"])
def test_train_refuses_in_one_line_and_writes_nothing(tmp_path, text_file, flags, message):
    before = snapshot(tmp_path)
    line = refused("train", "--out", tmp_path / "run", "--data", text_file, *TINY, *flags)
    assert line.startswith("mlx-llm train: error: ") and re.search(message, line), line
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_rl_refuses_a_top_k_past_the_vocabulary_before_compiling(tmp_path, arithmetic_sft, monkeypatch):
    """``rl --top-k 1000000`` was refused only by the decoder, after the update had compiled."""
    from mlx_llm.post import rl

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before refusing --top-k")

    monkeypatch.setattr(rl, "compiled_update", no_compile)
    before = snapshot(tmp_path)
    line = refused("rl", "--base", arithmetic_sft, "--task", "arithmetic", "--top-k", 1_000_000, "--seq-len", 64,
                   "--out", tmp_path / "o")
    assert line == ("mlx-llm rl: error: top_k = 1000000 is larger than the base model's vocabulary (V = 263): give "
                    "1 … 263, or leave --top-k unset for no cut")
    assert snapshot(tmp_path) == before
