"""The pre-flight compiler (train/preflight.py, ``mlx-llm compile``): the exact train step compiled ahead of time
for the local devices and for a real TPU topology (libtpu, the ``.[tpu]`` extra), its memory report, and the
refusals: a step that cannot fit, an unknown target, a kernel the backend cannot run — none of which writes
anything."""

import hashlib
import os
import json
from pathlib import Path

import jax
import pytest

from mlx_llm import cli
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.kernels import attention_path
from mlx_llm.train.preflight import GiB, compile_step, valid_targets

TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                   max_seq_len=512)
HYBRID = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_head=32, d_ff=256,
                     max_seq_len=512, ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2, moe_d_ff=128)
KEYS = {"target", "devices", "hbm_bytes_per_device", "bytes_per_device", "fits", "flops_per_step",
        "attention_impl", "moe_impl", "ssm_scan"}


def tree_hash(path: Path) -> str:
    """A digest of every file name and content under ``path`` (or a marker when it does not exist)."""
    if not path.exists():
        return "absent"
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        h.update(str(f.relative_to(path)).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def test_libtpu_never_sees_xla_cpu_flags(monkeypatch):
    """libtpu ends the process on an XLA flag it does not know (the suite's --xla_cpu_use_fusion_emitters=false
    took a pytest worker down with it): a TPU compile runs with XLA:CPU's flags hidden, restored after, even
    when the compile raises."""
    from mlx_llm.train import preflight

    flags = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", flags)
    with pytest.raises(RuntimeError, match="inside"):
        with preflight.without_cpu_flags():
            assert os.environ["XLA_FLAGS"] == ("--xla_backend_optimization_level=0 "
                                               "--xla_force_host_platform_device_count=8")
            raise RuntimeError("inside")
    assert os.environ["XLA_FLAGS"] == flags
    monkeypatch.delenv("XLA_FLAGS")
    with preflight.without_cpu_flags():
        assert "XLA_FLAGS" not in os.environ
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.slow
def test_tpu_topology_compile_uses_splash_and_megablox_and_fits():
    pytest.importorskip("libtpu")
    tcfg = TrainConfig(batch_size=8, seq_len=512, mesh="fsdp=4", attention_impl="splash", moe_impl="megablox",
                       loss_chunk="auto", compute_dtype="bfloat16")
    with jax.enable_x64(False):  # as a real run traces (the suite enables x64 for the seeds' numbers)
        out = compile_step(HYBRID, tcfg, "tpu:v5e-4")
    assert KEYS <= set(out)
    assert (out["target"], out["devices"], out["platform"]) == ("tpu:v5e-4", 4, "tpu")
    assert out["hbm_bytes_per_device"] == int(15.75 * GiB)
    assert out["fits"] is True
    assert {"splash_attention", "megablox_gmm"} <= set(out["kernels_in_program"])
    sizes = out["bytes_per_device"]
    assert sizes["total"] == sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporary"]
    assert 0 < sizes["total"] < 0.05 * out["hbm_bytes_per_device"]
    # float32 master weights + two AdamW moments, split 4 ways by fsdp (norm gains and offsets replicated)
    state = 3 * 4 * HYBRID.param_count() / 4
    assert state <= out["state_bytes_per_device"] <= min(1.1 * state, sizes["arguments"])
    assert out["flops_per_step"] > 6 * HYBRID.active_param_count() * 8 * 512 * 0.5  # accounting's count


@pytest.mark.slow
def test_tpu_topology_compile_of_a_sliding_window_stack_runs_splash_local_masks():
    """Local/global layers (a window of 128 in every other layer) compile for a real TPU topology with splash in
    both kinds of layer: the local ones through splash's LocalMask, inside shard_map like the global ones."""
    pytest.importorskip("libtpu")
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_head=32, d_ff=256,
                      max_seq_len=1024, mixer_pattern=("local", "attn"), sliding_window=128)
    tcfg = TrainConfig(batch_size=8, seq_len=1024, mesh="fsdp=4", attention_impl="splash", compute_dtype="bfloat16")
    with jax.enable_x64(False):
        out = compile_step(cfg, tcfg, "tpu:v5e-4")
    assert out["fits"] is True and out["attention_impl"] == "splash"
    assert "splash_attention" in out["kernels_in_program"]
    assert attention_path(tcfg.kernels("tpu", resolve=True), 1024, window=128) == "splash"


def run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_compile_json_on_local_devices(tmp_path, capsys):
    TINY.to_json(tmp_path / "config.json")
    code, out, _ = run_cli(["compile", "--config", str(tmp_path / "config.json"), "--batch-size", "4",
                            "--seq-len", "64", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert KEYS <= set(report)
    assert (report["target"], report["fits"], report["attention_impl"], report["moe_impl"]) == ("local", True,
                                                                                                 "auto", "block")
    assert report["tokens_per_step"] == 256 and report["bytes_per_device"]["temporary"] > 0


@pytest.mark.slow
def test_step_that_cannot_fit_exits_1_with_the_knobs(tmp_path, capsys):
    huge = ModelConfig(vocab_size=256, d_model=65536, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=65536,
                       max_seq_len=512)
    huge.to_json(tmp_path / "config.json")
    code, out, err = run_cli(["compile", "--config", str(tmp_path / "config.json"), "--batch-size", "4",
                              "--seq-len", "64"], capsys)
    assert code == 1
    assert "fits: no" in out
    assert "the train step does not fit: needs" in err and "--remat full" in err and "--batch-size" in err


@pytest.mark.slow
def test_train_refuses_before_creating_the_run_directory(tmp_path, capsys):
    huge = ModelConfig(vocab_size=256, d_model=65536, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=65536,
                       max_seq_len=512)
    huge.to_json(tmp_path / "config.json")
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--config", str(tmp_path / "config.json"), "--data", str(data), "--tokenizer",
                            "byte", "--out", str(run), "--batch-size", "4", "--seq-len", "64", "--no-progress"],
                           capsys)
    assert code == 2 and "the train step does not fit" in err
    assert tree_hash(run) == "absent"
    code, _, err = run_cli(["train", "--data", str(data), "--tokenizer", "byte", "--out", str(run),
                            "--attention-impl", "splash", "--steps", "40", "--no-progress"], capsys)
    assert code == 2 and "attention_impl = 'splash' is a TPU kernel and this backend is 'cpu'" in err
    assert tree_hash(run) == "absent"


def test_unknown_target_lists_the_valid_ones(capsys):
    code, _, err = run_cli(["compile", "--target", "tpu:v5e-3"], capsys)
    assert code == 2 and "unknown target 'tpu:v5e-3': valid targets are ['local', " in err
    assert {"tpu:v5e-4", "tpu:v5p-16", "tpu:v6e-4", "tpu:v4-8"} <= set(valid_targets())
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", "--loss-chunk", "some"])
    assert exit_.value.code == 2 and "invalid value 'some': give a number of rows" in capsys.readouterr().err


def test_post_training_update_is_refused_when_it_cannot_fit(monkeypatch):
    """reward / DPO / RL compile their update before the run directory exists (train/preflight.compiled_update); one
    that needs more than a device holds is refused in one line (here: a device of 1 KiB)."""
    import jax.numpy as jnp

    from mlx_llm.errors import ConfigError
    from mlx_llm.train import preflight

    def loss_fn(trainable, frozen, batch, key):  # train.step.make_update's objective form: sums and a count
        n = jnp.asarray(batch["x"].shape[0], jnp.float32)
        return jnp.sum(jnp.mean((batch["x"] @ trainable["w_up"] - frozen["y"]) ** 2, axis=-1)), (n, None, {})

    # a weight the layout declares (AdamW's decay groups come from layers/layout.py)
    trainable, frozen = {"w_up": jnp.ones((64, 8), jnp.float32)}, {"y": jnp.zeros((16, 8), jnp.float32)}
    batch = {"x": jnp.ones((16, 64), jnp.float32)}
    tcfg = TrainConfig(steps=2, warmup_steps=1)
    step = preflight.compiled_update(TINY, tcfg, loss_fn, trainable, frozen, batch)
    assert step.memory_analysis().argument_size_in_bytes > 0
    small = preflight.Target("local", tuple(jax.devices()), "cpu", 1024)
    monkeypatch.setattr(preflight, "local_target", lambda: small)
    with pytest.raises(ConfigError, match=r"the update step does not fit: it needs .* GiB per device, .* more than "
                                          r"the 0.00 GiB here; try LoRA \(--lora-rank\) or a smaller --batch-size"):
        preflight.compiled_update(TINY, tcfg, loss_fn, trainable, frozen, batch)
