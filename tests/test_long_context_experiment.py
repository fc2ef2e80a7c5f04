"""experiments/long_context.py (issue 24, part 5) end to end in its ``--quick`` form: the base run, the RoPE
settings at 2× and 4× its context with and without a fine-tune, and sliding-window decoding against full attention
(about a minute on 2 quiet cores)."""

import json
import math

import jax
import pytest

from experiments import long_context as lc
from mlx_llm.recipes import BASE_MODEL
from mlx_llm.runs.record import open_run


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    with jax.enable_x64(False):  # the float32 path the script runs (the suite enables x64 for the seeds)
        assert lc.main(["--quick", "--out", str(out / "runs"), "--cache-dir", str(out / "cache")]) == 0
    return out / "runs", json.loads((out / "runs" / "long_context.json").read_text())


@pytest.mark.slow
def test_rope_rows(quick):
    out, result = quick
    t0 = lc.QUICK.base.seq_len
    rows = {(r["method"], r["T"]): r for r in result["extension"]}
    assert set(rows) == {(m, f * t0) for m in lc.METHODS for f in lc.FACTORS}
    assert result["reference"]["T"] == t0 and "provenance" in result
    for (method, t), r in rows.items():
        assert math.isfinite(r["val_bpb"]) and math.isfinite(r["val_bpb_finetuned"])
        # a 12-step model gains from any 3 more steps
        assert r["val_bpb_finetuned"] < r["val_bpb"], (method, t)
        want = {"none": {}, "linear": {"rope_scaling": "linear", "rope_scale": t0 / t}}.get(
            method, {"rope_scaling": method, "rope_factor": t / t0, "rope_original_max_len": t0})
        assert r["rope"] == want
        run = open_run(out / f"ft-{method}-{t}")  # each fine-tune is a run of its own, with the scaled config
        assert run.tcfg.seq_len == t and run.tcfg.steps == lc.QUICK.ft_steps
        assert {k: getattr(run.cfg, k) for k in want} == want
        assert run.record.provenance["initialised_from"]["run"] == str(out / "base")
    for method in ("linear", "dynamic", "yarn"):  # each scaling reaches the attention layers
        assert rows[(method, 2 * t0)]["val_bpb"] != rows[("none", 2 * t0)]["val_bpb"], method


@pytest.mark.slow
def test_decode_rows(quick):
    _, result = quick
    window, m = lc.QUICK.window, BASE_MODEL
    per_position = 2 * m.n_layers * m.n_kv_heads * m.d_head * 4  # K and V, float32
    rows = {r["context"]: r for r in result["decode"]["rows"]}
    assert sorted(rows) == [1024, 4096]
    for ctx, r in rows.items():
        assert r["local"]["state_bytes"] == window * per_position  # the ring buffer: flat beyond W
        assert r["attn"]["state_bytes"] == ctx * per_position
        assert r["local"]["allocated_bytes"] == window * per_position + 4  # + the lengths counter
        for kind in ("local", "attn"):
            assert r[kind]["seconds_per_token"] > 0
            assert r[kind]["tokens_per_second"] == pytest.approx(1 / r[kind]["seconds_per_token"])
    assert rows[4096]["attn"]["state_bytes"] == 4 * rows[1024]["attn"]["state_bytes"]
