"""Sharded training (train/parallel.py): the per-key sharding rule, meshes of 8 simulated CPU devices equal one
device, per-device parameter bytes, checkpoints across meshes, remat's compiled memory."""

import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from mlx_llm import ModelConfig
from mlx_llm.config import MESH_AXES, TrainConfig, parse_mesh
from mlx_llm.errors import ConfigError
from mlx_llm.train.parallel import mesh_shape, param_spec
from helpers import cli, python, subprocess_env

REPO = Path(__file__).resolve().parents[1]


def abstract_mesh(data=1, fsdp=1, tensor=1):
    return AbstractMesh((data, fsdp, tensor), MESH_AXES)


@pytest.mark.parametrize("keys, shape, mesh, spec", [
    (("blocks", "wq"), (4, 64, 8, 16), abstract_mesh(fsdp=4), P(None, "fsdp", None, None)),  # L never split
    (("blocks", "wq"), (4, 64, 8, 16), abstract_mesh(fsdp=4, tensor=2), P(None, "fsdp", "tensor", None)),
    (("blocks", "wo"), (4, 8, 16, 64), abstract_mesh(fsdp=4, tensor=2), P(None, "tensor", None, "fsdp")),
    (("blocks", "wk"), (4, 64, 2, 16), abstract_mesh(tensor=4), P(None, None, None, None)),  # 2 kv heads: no split
    (("blocks", "w_down"), (4, 176, 64), abstract_mesh(fsdp=8, tensor=2), P(None, "tensor", "fsdp")),
    (("blocks", "w_gate"), (4, 64, 176), abstract_mesh(fsdp=8), P(None, None, "fsdp")),  # the largest axis
    (("blocks", "attn_norm"), (4, 64), abstract_mesh(fsdp=8), P(None, "fsdp")),
    (("blocks", "attn_norm"), (4, 12), abstract_mesh(fsdp=8), P(None, None)),  # nothing divisible: replicated
    (("embed",), (4096, 64), abstract_mesh(fsdp=4, tensor=2), P("tensor", "fsdp")),
    (("unembed",), (64, 4096), abstract_mesh(fsdp=4), P(None, "fsdp")),
    (("final_norm",), (64,), abstract_mesh(data=8), P(None)),
    (("blocks", "expert_up"), (2, 8, 64, 32), abstract_mesh(fsdp=8, tensor=2), P(None, None, "fsdp", "tensor")),
    (("blocks", "A_log"), (2, 128, 16), abstract_mesh(fsdp=4, tensor=2), P(None, "tensor", "fsdp")),
    (("mu", "blocks", "wq"), (4, 64, 8, 16), abstract_mesh(fsdp=4), P(None, "fsdp", None, None)),  # Adam moment
    (("blocks", "wq", "A"), (4, 64, 8), abstract_mesh(fsdp=4), P(None, "fsdp", None)),  # LoRA adapter
    (("count",), (), abstract_mesh(fsdp=4), P()),
])
def test_param_spec_rule(keys, shape, mesh, spec):
    assert param_spec(keys, shape, mesh) == spec


def test_mesh_spec_parsing_and_errors():
    assert parse_mesh("data=2, fsdp=4") == {"data": 2, "fsdp": 4}
    assert parse_mesh("") == {}
    assert mesh_shape("", 8) == (8, 1, 1)
    assert mesh_shape("data=2,fsdp=-1", 8) == (2, 4, 1)
    assert mesh_shape("tensor=2,fsdp=2,data=2", 8) == (2, 2, 2)
    for bad, msg in [("data=2,model=4", "'model=4' is invalid"), ("data=0", "data = 0 is invalid"),
                     ("data=-1,fsdp=-1", "at most one axis"), ("data=2,data=2", "each at most once"),
                     ("fsdp=x", "'fsdp=x' is invalid")]:
        with pytest.raises(ConfigError, match=msg):
            parse_mesh(bad)
    with pytest.raises(ConfigError, match="has 6 devices but 8 are available"):
        mesh_shape("data=2,fsdp=3", 8)
    with pytest.raises(ConfigError, match="does not divide the 8 device"):
        mesh_shape("fsdp=3,data=-1", 8)
    with pytest.raises(ConfigError, match="TrainConfig.remat = 'some' is invalid"):
        TrainConfig(remat="some")
    with pytest.raises(ConfigError, match="'pipe=2' is invalid"):
        TrainConfig(mesh="pipe=2")


@pytest.mark.slow
def test_remat_lowers_compiled_memory_and_keeps_gradients():
    """jax.checkpoint per layer: the same loss and gradients, and less temporary memory in the compiled step
    (XLA's own memory analysis of the compiled executable)."""
    from mlx_llm.train.step import summed_loss

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_head=8, d_ff=96,
                      max_seq_len=64)
    from mlx_llm.model import init_params
    from mlx_llm.train.step import summed_loss_and_aux

    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 64, (8, 64)), "targets": rng.integers(0, 64, (8, 64)),
             "mask": np.ones((8, 64), np.float32), "segment_ids": np.zeros((8, 64), np.int32),
             "positions": np.tile(np.arange(64), (8, 1))}
    results = {}
    for remat in ("none", "dots", "full"):
        fn = jax.jit(jax.grad(lambda p, b: summed_loss_and_aux(p, b, cfg, jnp.float32, remat)[0]))
        compiled = fn.lower(params, batch).compile()
        results[remat] = (compiled.memory_analysis().temp_size_in_bytes, compiled(params, batch))
    for remat in ("dots", "full"):
        for a, b in zip(jax.tree.leaves(results[remat][1]), jax.tree.leaves(results["none"][1])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # recomputation reorders float sums
    assert results["full"][0] < results["none"][0]
    assert results["full"][0] <= results["dots"][0]
    assert float(summed_loss(params, batch, cfg, jnp.float32)[0]) > 0


MESH_SCRIPT = textwrap.dedent("""
    import json, tempfile
    import jax, numpy as np
    from mlx_llm import ModelConfig
    from mlx_llm.config import TrainConfig
    from mlx_llm.train.checkpoint import Checkpoints, abstract_like
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for, place_state
    assert jax.device_count() == 8, jax.devices()
    # one mixed stack holds every dense sublayer and an MoE FFN with moving offsets (period 2: a list of blocks)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, d_head=4, d_ff=24,
                      max_seq_len=16, ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2, moe_d_ff=8,
                      offset_rate=0.01)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 64, (8, 16)), "targets": rng.integers(0, 64, (8, 16)),
                "mask": (rng.random((8, 16)) < 0.8).astype(np.float32),
                "segment_ids": np.zeros((8, 16), np.int32), "positions": np.tile(np.arange(16), (8, 1))}
               for _ in range(3)]

    def train(cfg, mesh_spec, devices=None):
        tcfg = TrainConfig(batch_size=8, seq_len=16, steps=3, lr=1e-3, warmup_steps=1, mesh=mesh_spec)
        mesh = make_mesh(mesh_spec, devices)
        state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg)), mesh)
        step = jit_train_step(cfg, tcfg, mesh)
        losses = []
        for b in batches:
            state, m = step(state, device_batch(b, mesh))
            losses.append(float(m["loss"]))
        return state, losses, mesh

    def per_device_fraction(tree):
        leaves = jax.tree.leaves(tree)
        return sum(a.addressable_shards[0].data.nbytes for a in leaves) / sum(a.nbytes for a in leaves)

    out = {}
    ref, ref_losses, _ = train(cfg, "", jax.devices()[:1])
    ref_params = [np.asarray(a) for a in jax.tree.leaves(ref.params)]
    for spec in ("data=8", "data=2,fsdp=4", "fsdp=8", "data=2,fsdp=2,tensor=2"):
        state, losses, mesh = train(cfg, spec)
        out[spec] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(float(np.max(np.abs(np.asarray(a) - b)))
                              for a, b in zip(jax.tree.leaves(state.params), ref_params)),
            "offsets_moved": float(np.abs(np.asarray(state.params["blocks"][0]["router_offset"])).max()),
            "param_fraction": per_device_fraction(state.params),
            "opt_fraction": per_device_fraction(state.opt_state),
            "wq_spec": str(state.params["blocks"][0]["wq"].sharding.spec),
        }
        if spec == "data=2,fsdp=4":
            saved = state
    # a checkpoint written under data=2 x fsdp=4 restores under fsdp=8 and under one device
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpoints(d)
        ck.save(3, saved)
        for spec, devices in (("fsdp=8", None), ("", jax.devices()[:1])):
            tcfg = TrainConfig(batch_size=8, seq_len=16, steps=3, lr=1e-3, warmup_steps=1, mesh=spec)
            like = place_state(init_state(cfg, tcfg, optimizer_for(tcfg)), make_mesh(spec, devices))
            restored = ck.restore(abstract_like(like))
            out[f"restore {spec or 'one device'}"] = {
                "equal": all(np.array_equal(np.asarray(a), np.asarray(b))
                             for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved))),
                "same_shardings": all(a.sharding == b.sharding
                                      for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like))),
                "fraction": per_device_fraction(restored.params)}
        ck.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight_devices():
    proc = python("-c", MESH_SCRIPT, devices=8, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["data=8", "data=2,fsdp=4", "fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_sharded_training_equals_one_device(eight_devices, spec):
    """3 steps of a mixed attention/MoE/SwiGLU stack: losses and parameters (MoE offsets included, which the
    control rule moves from loads counted over the global batch) equal the one-device run's: losses to 1e-6;
    weights to 2e-6, since float32 sums in another order differ in the last bits and Adam's m/√v, for a
    gradient near zero (an unembedding column of a token absent from the batch), divides that rounding
    difference by the gradient's own tiny size (measured: ≤ 1.2e-6; most weights agree to 6e-8)."""
    r = eight_devices[spec]
    assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 2e-6, r
    assert r["offsets_moved"] > 0


@pytest.mark.slow
def test_fsdp_splits_parameter_and_optimizer_bytes(eight_devices):
    """Per-device bytes read from the arrays' shardings: ≈ total / fsdp (norm gains and the tiny MoE offsets
    stay replicated, hence the small excess), and every device holds everything on a data-only mesh."""
    assert eight_devices["data=8"]["param_fraction"] == 1.0
    for spec, fsdp in (("fsdp=8", 8), ("data=2,fsdp=4", 4)):
        r = eight_devices[spec]
        assert 1 / fsdp <= r["param_fraction"] < 1.1 / fsdp, r
        assert 1 / fsdp <= r["opt_fraction"] < 1.1 / fsdp, r
    assert eight_devices["fsdp=8"]["wq_spec"] == str(P(None, "fsdp", None, None))
    assert eight_devices["data=2,fsdp=2,tensor=2"]["wq_spec"] == str(P(None, "fsdp", "tensor", None))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fsdp=8", "one device"])
def test_checkpoint_restores_under_another_mesh(eight_devices, target):
    r = eight_devices[f"restore {target}"]
    assert r["equal"] and r["same_shardings"], r
    assert r["fraction"] < 1.1 / 8 if target == "fsdp=8" else r["fraction"] == 1.0


# ----- several processes ------------------------------------------------------------------------------------
TINY = dict(vocab_size=263, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32, max_seq_len=32)
TRAIN_ARGS = ["--tokenizer", "byte", "--extensions", ".py", "--val-percent", "20", "--steps", "3", "--warmup-steps",
              "1", "--batch-size", "8", "--seq-len", "16", "--lr", "1e-3", "--eval-interval", "3", "--eval-tokens",
              "128", "--checkpoint-interval", "3", "--log-interval", "1", "--sample-tokens", "4", "--no-progress",
              "--mesh", "data=2,fsdp=2"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The same 3-step run (mesh data=2 × fsdp=2) by one process with 4 devices, and by 2 processes with 2
    devices each joined through jax.distributed (gloo collectives on the CPU), each reading its half of every
    global batch."""
    root = tmp_path_factory.mktemp("multiprocess")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "for", "in", "if", "x", "(", ")", ":"]
    for i in range(6):
        (corpus / f"f{i}.py").write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(40)))
    (root / "model.json").write_text(json.dumps(TINY))
    common = ["-m", "mlx_llm", "train", "--data", str(corpus), "--config", str(root / "model.json"), *TRAIN_ARGS]
    single = python(*common, "--out", root / "one", "--cache-dir", root / "c1", devices=4)
    assert single.returncode == 0, single.stderr[-3000:]
    port = _free_port()
    procs = [python(*common, "--out", root / "two", "--cache-dir", root / "c2", "--coordinator", f"127.0.0.1:{port}",
                    "--num-processes", 2, "--process-id", i, devices=2, popen=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return root / "one", root / "two", [out for out, _ in outs]


def _metric_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_equal_one_process(two_process_runs):
    from mlx_llm.runs.load import load_params

    one, two, stdouts = two_process_runs
    rows1, rows2 = _metric_rows(one), _metric_rows(two)
    assert [r["step"] for r in rows2 if "loss" in r] == [1, 2, 3]  # process 0 alone writes: each step once
    for a, b in zip(rows1, rows2):
        assert a["step"] == b["step"]
        for k in ("loss", "val_loss"):
            if k in a:
                assert abs(a[k] - b[k]) <= 1e-6, (k, a, b)
    p1 = load_params(one)
    p2 = load_params(two)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2))) <= 1e-6
    assert json.loads((two / "summary.json").read_text())["devices"] == 4
    assert "run:" in stdouts[0] and (two / "sample.txt").is_file()


@pytest.mark.slow
def test_bad_multiprocess_settings_are_refused(monkeypatch, tmp_path):
    from mlx_llm.train.parallel import init_distributed

    with pytest.raises(ConfigError, match=r"process id = 5 is invalid: it must be in \[0, 2\)"):
        init_distributed("127.0.0.1:1", 2, 5)
    with pytest.raises(ConfigError, match="number of processes = 0 is invalid"):
        init_distributed("127.0.0.1:1", 0, 0)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES = 'two' is not an integer"):
        init_distributed()
    # nothing to join (no flags, no environment, no cluster): one line, exit 2, no run directory
    env = {k: v for k, v in subprocess_env().items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    proc = cli("train", "--distributed", "--out", tmp_path / "r", env=env, timeout=300)
    assert proc.returncode == 2 and "cannot join a multi-process run" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
