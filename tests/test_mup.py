"""μP (layers/layout.py's rules, train.optim.mup_lr_scales, scaling/mup.py): every rule in closed form at width 256
over a base of 64; μP at its base width is SP exactly; the optimizer chain's per-leaf multipliers for AdamW and
Muon; the coordinate check (flat under μP, growing under SP); --watch-interval's update RMS of real runs (a hidden
matrix's ¼ at width 256, the embedding's the same); the standard model of a μP one and its HF export."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.layers import layout
from mlx_llm.scaling import mup
from mlx_llm.train.optim import mup_lr_scales, multiply_scales, scale_per_leaf
from mlx_llm.train.step import optimizer_for
from helpers import cli_in_process, snapshot

BASE = dict(vocab_size=64, n_layers=2, d_head=16, max_seq_len=32)
MUP = dict(parametrization="mup", mup_base_width=64, mup_base_head_width=16)
HIDDEN = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def at(d: int, **kw) -> ModelConfig:
    """Width d with heads of 16 and d_ff = 4d: every width dimension grows by d/64 from the base."""
    return ModelConfig(d_model=d, n_heads=d // 16, n_kv_heads=d // 16, d_ff=4 * d, **BASE, **kw)


# ----- the rules, in closed form ---------------------------------------------------------------------------------
def test_rules_at_four_times_the_base_width():
    cfg = at(256, **MUP)
    e = layout.entries()
    assert cfg.width_mult == 4.0 and at(256).width_mult == 1.0
    assert {k: layout.mup_class(e[k]) for k in ("embed", "unembed", "attn_norm", "bq", *HIDDEN)} == {
        "embed": "input", "unembed": "output", "attn_norm": "vector", "bq": "vector", **dict.fromkeys(HIDDEN, "hidden")}
    assert layout.mup_class(e["router"]) == "output"  # why μP refuses MoE: an output-like matrix inside the stack
    for k in HIDDEN:  # AdamW: η/m_in; Muon: √(fo/fi)/√max(fi, fo) over the base's = 1/√4
        assert layout.fan_mult(e[k], cfg) == (4.0, 4.0)
        assert layout.mup_lr_mult(e[k], cfg, "adamw") == 0.25
        assert layout.mup_lr_mult(e[k], cfg, "muon") == pytest.approx(0.5, rel=1e-15)
    for k in ("embed", "unembed", "attn_norm", "final_norm"):
        assert layout.mup_lr_mult(e[k], cfg, "adamw") == layout.mup_lr_mult(e[k], cfg, "muon") == 1.0
    # init: the unembedding's σ is the base's 1/√64, not 1/√256; the rest keep theirs
    assert layout.mup_init_mult(e["unembed"], cfg) * e["unembed"].std(cfg) == pytest.approx(1 / 8, rel=1e-15)
    assert layout.mup_init_mult(e["wq"], cfg) == layout.mup_init_mult(e["embed"], cfg) == 1.0
    assert layout.embed_std(at(256, tie_embeddings=True, **MUP)) == pytest.approx(1 / 8, rel=1e-15)
    assert layout.embed_std(at(256, tie_embeddings=True)) == pytest.approx(1 / 16, rel=1e-15)
    # forward: logits × 1/m; attention q·k·√16/d_h (d_h = 16: SP's 1/√16, so Q × 1); without the base head width 1/d_h
    assert layout.output_mult(cfg) == 0.25 and layout.attention_q_mult(cfg) == 1.0
    no_head_base = at(256, parametrization="mup", mup_base_width=64)
    assert layout.attention_q_mult(no_head_base) == pytest.approx(1 / 4, rel=1e-15)  # 1/√16: q·k/16 = q·k/d_h
    wide_heads = ModelConfig(d_model=256, n_heads=4, n_kv_heads=4, d_ff=1024, **{**BASE, "d_head": 64}, **MUP)
    assert layout.attention_q_mult(wide_heads) == pytest.approx(0.5, rel=1e-15)  # √(16/64): q·k·4/64 = q·k/16
    assert layout.width_mult("K", wide_heads) == 4.0 and layout.width_mult("H", wide_heads) == 1.0
    assert layout.mup_lr_mult(e["wq"], wide_heads) == 0.25  # fan_out h·d_h = 256 grows by 4 through d_h


def test_unembedding_draws_at_the_base_scale():
    p = init_params(at(256, **MUP), jax.random.key(0))
    assert float(jnp.std(p["unembed"])) == pytest.approx(1 / 8, rel=0.03)  # 16 384 draws: ±1.1 % (1σ)
    assert float(jnp.std(p["blocks"]["wq"])) == pytest.approx(1 / 16, rel=0.03)


@pytest.mark.slow
def test_mup_at_its_base_width_is_sp():
    """m = 1 and d_h = d₀: the same parameters, logits and optimizer updates as SP, bit for bit."""
    sp, mu = at(64), at(64, **MUP)
    p1, p2 = init_params(sp, jax.random.key(1)), init_params(mu, jax.random.key(1))
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    ids = np.random.default_rng(0).integers(0, 64, (2, 12))
    np.testing.assert_array_equal(forward(p1, ids, sp), forward(p2, ids, mu))
    tcfg = TrainConfig(steps=4, warmup_steps=1, lr=1e-2)
    grads = jax.tree.map(lambda a: jnp.cos(a * 7.0), p1)
    u1, _ = optimizer_for(tcfg, cfg=sp).update(grads, optimizer_for(tcfg, cfg=sp).init(p1), p1)
    u2, _ = optimizer_for(tcfg, cfg=mu).update(grads, optimizer_for(tcfg, cfg=mu).init(p2), p2)
    jax.tree.map(np.testing.assert_array_equal, u1, u2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_the_chain_multiplies_each_leaf(kind):
    """The run's chain at width 256 under μP gives SP's update at the same width times ``mup_lr_scales``: ¼ (AdamW)
    or ½ (Muon) on every hidden matrix, 1 on the tables and gains (one lr for both optimizers, as Muon's docs say)."""
    sp, mu = at(256), at(256, **MUP)
    params = init_params(sp, jax.random.key(2))
    grads = jax.tree.map(lambda a: jnp.sin(a * 5.0 + 0.1), params)
    tcfg = TrainConfig(steps=4, warmup_steps=1, lr=1e-2, optimizer=kind)
    ref, ours = optimizer_for(tcfg, cfg=sp), optimizer_for(tcfg, cfg=mu)
    u_sp, _ = ref.update(grads, ref.init(params), params)
    u_mu, _ = ours.update(grads, ours.init(params), params)
    scales = mup_lr_scales(params, mu, kind)
    want = 0.25 if kind == "adamw" else 0.5
    assert {k: scales["blocks"][k] for k in HIDDEN} == dict.fromkeys(HIDDEN, pytest.approx(want, rel=1e-15))
    assert scales["embed"] == scales["unembed"] == scales["blocks"]["attn_norm"] == 1.0
    jax.tree.map(lambda a, b, s: np.testing.assert_allclose(b, s * a, rtol=1e-6, atol=1e-12), u_sp, u_mu, scales)
    assert mup_lr_scales(params, sp, kind) == jax.tree.map(lambda _: 1.0, params)


def test_multiplier_trees_compose_into_one_step():
    """``multiply_scales``: several multiplier trees (μP's and any other per-leaf rule) multiply leafwise and
    ``scale_per_leaf`` applies the product in one step; None entries drop out, none at all gives None."""
    mu = at(256, **MUP)
    tree = {"embed": jnp.ones((4, 256)), "blocks": {"wq": jnp.ones((2, 256, 256)), "attn_norm": jnp.ones((2, 256))}}
    other = lambda t: {"embed": 3.0, "blocks": {"wq": 2.0, "attn_norm": 0.5}}  # noqa: E731
    mine = functools.partial(mup_lr_scales, cfg=mu)
    both = multiply_scales(mine, None, other)
    assert both(tree) == {"embed": 3.0, "blocks": {"wq": pytest.approx(0.5, rel=1e-15), "attn_norm": 0.5}}
    assert multiply_scales(None, mine) is mine and multiply_scales(None) is None
    step = scale_per_leaf(both)
    out, _ = step.update(tree, step.init(tree))
    assert [float(x.reshape(-1)[0]) for x in jax.tree.leaves(out)] == [0.5, 0.5, 3.0]


def test_lora_factors_and_heads_keep_the_schedules_rate():
    mu = at(256, **MUP)
    tree = {"blocks": {"wq": {"A": jnp.zeros((2, 256, 4)), "B": jnp.zeros((2, 4, 256))}}, "reward_head": jnp.zeros(256)}
    assert jax.tree.leaves(mup_lr_scales(tree, mu)) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="kind = 'sgd' is invalid"):
        mup_lr_scales(tree, mu, "sgd")


@pytest.mark.parametrize("fields,message", [
    ({"parametrization": "mu-p"}, "parametrization = 'mu-p' is invalid: valid values are \\['sp', 'mup'\\]"),
    ({"mup_base_width": 64}, "mup_base_width = 64 set\\(s\\) the μP base model, but parametrization = 'sp'"),
    ({"parametrization": "mup"}, "mup_base_width is not set"),
    ({"parametrization": "mup", "mup_base_width": 0}, "mup_base_width"),
    ({**MUP, "ffn_pattern": ("moe",), "n_experts": 4, "moe_top_k": 1, "moe_d_ff": 32}, "no rules for layer kind"),
])
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        at(64, **fields)


def test_cli_refusal_is_one_line_and_writes_nothing(tmp_path):
    before = snapshot(tmp_path)
    proc = cli_in_process("train", "--out", tmp_path / "run", "--set", "model.parametrization=mup", "--steps", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "mup_base_width is not set" in proc.stderr and snapshot(tmp_path) == before


def test_analytic_backward_refuses_mup():
    from mlx_llm.objectives.grads import analytic_value_and_grad

    cfg = at(64, **MUP)
    ids = np.zeros((1, 4), np.int32)
    with pytest.raises(ConfigError, match="standard parametrization"):
        analytic_value_and_grad(init_params(cfg, jax.random.key(0)), ids, ids, np.ones((1, 4)), cfg)


# ----- the standard model of a μP one ----------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": True}, {"qk_norm": True, "mup_base_head_width": None},
                                   {"qkv_bias": True, "mup_base_head_width": 4}], ids=["untied", "tied", "qk_norm",
                                                                                       "qkv_bias"])
def test_to_standard_computes_the_same_function(extra):
    cfg = at(128, **{**MUP, **extra})
    params = jax.tree.map(lambda a: a + 0.01 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
                          init_params(cfg, jax.random.key(3)))  # gains and biases off their initial values
    std_params, std_cfg = mup.to_standard(params, cfg)
    assert std_cfg.parametrization == "sp" and not std_cfg.tie_embeddings and std_cfg.mup_base_width is None
    ids = np.random.default_rng(4).integers(0, 64, (2, 16))
    np.testing.assert_allclose(forward(std_params, ids, std_cfg), forward(params, ids, cfg), rtol=1e-12, atol=1e-12)
    assert mup.to_standard(std_params, std_cfg) == (std_params, std_cfg)


def test_with_width_scales_every_width():
    c = mup.with_width(at(64, **MUP), 192)
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.d_head, c.mup_base_width) == (192, 12, 12, 768, 16, 64)
    with pytest.raises(InputError, match="n_heads = 4 × 40/64 = 2.5 is not a whole number"):
        mup.with_width(at(64), 40)


# ----- the coordinate check ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_coord_check_is_flat_under_mup_and_grows_under_sp():
    """Yang et al.'s coordinate check at widths 64…512, Adam at η = 1e-2, 3 steps on one batch: under μP every
    activation's RMS at 512 is within 1.5× of its RMS at 64 (measured: 0.80–0.99); under SP the branch outputs and
    the logits grow (measured 2.4–12×). Activations at initialisation are width-independent in both (same
    init), so what differs is the updates."""
    widths = (64, 128, 256, 512)
    flat = mup.coord_check(at(64, **MUP), widths, steps=3, lr=1e-2)
    grows = mup.coord_check(at(64), widths, steps=3, lr=1e-2)
    assert set(flat.rms) == {"embed", "logits", *(f"layer{l}.{k}" for l in (0, 1) for k in ("attn", "ffn", "out"))}
    assert flat.rms["logits"].shape == (4, 4) and flat.losses.shape == (4, 4)
    assert all(1 / 1.5 <= r <= 1.5 for r in flat.spread(3).values()), flat.spread(3)
    sp = grows.spread(3)
    assert all(sp[f"layer{l}.{k}"] > 2.0 for l in (0, 1) for k in ("attn", "ffn", "out")) and sp["logits"] > 2.0, sp
    for name, v in grows.rms.items():  # SP: the RMS rises with width at every step after the first
        if name != "embed":
            assert np.all(np.diff(v[:, 3]) > 0), (name, v[:, 3])
    np.testing.assert_allclose(grows.rms["embed"][:, 0], flat.rms["embed"][:, 0], rtol=1e-6)
    assert np.all(flat.losses[:, -1] < flat.losses[:, 0])  # every width learned the batch


# ----- real runs: --watch-interval's update RMS, and the HF export ------------------------------------------------
def _train(root, name: str, width: int, *extra):
    """A one-step byte-level run at ``width`` (heads of 16, d_ff = 4d, one layer) with Adam (no decay) at η = 1e-2,
    per-layer RMS watched at the step."""
    cfg_file = root / f"{name}.json"
    cfg_file.write_text(json.dumps(dict(vocab_size=263, d_model=width, n_layers=1, n_heads=width // 16,
                                        n_kv_heads=width // 16, d_head=16, d_ff=4 * width, max_seq_len=32)))
    proc = cli_in_process("train", "--out", root / name, "--config", cfg_file, "--data", root / "corpus",
                          "--extensions", ".py", "--tokenizer", "byte", "--steps", "1", "--warmup-steps", "0",
                          "--batch-size", "4", "--seq-len", "32", "--optimizer", "adamw", "--lr", "1e-2",
                          "--weight-decay", "0", "--watch-interval", "1", "--eval-tokens", "64", "--no-progress",
                          "--sample-tokens", "1", "--cache-dir", root / "cache", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "update_rms" in r)["update_rms"]


@pytest.fixture(scope="module")
def watched(tmp_path_factory, corpus_dir):
    root = tmp_path_factory.mktemp("mup_runs")
    (root / "corpus").symlink_to(corpus_dir)
    mu = ("--set", "model.parametrization=mup", "--set", "model.mup_base_width=64")
    return root, {(p, w): _train(root, f"{p}{w}", w, *(mu if p == "mup" else ())) for p in ("sp", "mup")
                  for w in (64, 256)}


@pytest.mark.slow
def test_watched_update_rms_follows_mup(watched):
    """Adam's first update is η·s·g/(|g| + ε) per coordinate (m̂ = g, v̂ = g²; no decay), so its RMS is η·s up to
    ε = 1e-8 against the clipped gradients' entries (≳ 1e-5 here: within 2e-3): a hidden matrix's at width 256 is ¼
    of width 64's under μP (s = 64/256) and equal under SP; the embedding's (s = 1, the same tokens touched at both
    widths) equal under both, as the unembedding's."""
    _, rms = watched
    for key in HIDDEN:
        ratio_mup = rms[("mup", 256)][key][0] / rms[("mup", 64)][key][0]
        ratio_sp = rms[("sp", 256)][key][0] / rms[("sp", 64)][key][0]
        print(f"{key}: μP {ratio_mup:.5f}, SP {ratio_sp:.5f}")
        assert ratio_mup == pytest.approx(0.25, rel=2e-3) and ratio_sp == pytest.approx(1.0, rel=2e-3), key
    assert rms[("mup", 64)]["wq"][0] == pytest.approx(1e-2, rel=2e-3)  # η itself at the base width
    for p in ("sp", "mup"):
        for key in ("embed", "unembed"):
            print(f"{p} {key}: {rms[(p, 256)][key]:.6g} vs {rms[(p, 64)][key]:.6g}")
            assert rms[(p, 256)][key] == pytest.approx(rms[(p, 64)][key], rel=2e-3)


@pytest.mark.slow
def test_hf_export_of_a_mup_run_gives_our_logits(watched, tmp_path):
    """The width-256 μP run exported: config.json is a standard Llama (no μP field), the weights carry α·U and
    the attention scale, and transformers (a model built here from that directory) gives our logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mlx_llm.runs.load import load_params
    from mlx_llm.runs.record import open_run

    root, _ = watched
    proc = cli_in_process("export", "--run", root / "mup256", "--to", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "parametrization" not in json.dumps(config) and config["tie_word_embeddings"] is False
    run = open_run(root / "mup256")
    assert run.cfg.parametrization == "mup" and run.cfg.width_mult == 4.0
    params = load_params(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(5).integers(0, 263, (2, 20))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(forward(params, ids, run.cfg))
    assert np.abs(ours - theirs).max() <= 1e-4 * max(1.0, float(np.abs(ours).max()))
    assert math.isclose(float(np.abs(ours).max()), float(np.abs(theirs).max()), rel_tol=1e-4)


def assert_same_numbers(got, want, path="result"):
    """The same structure and keys, every number equal to 1e-9 relative: the fits (least squares through
    LAPACK) move in their last digits between NumPy builds, any real change moves them far more."""
    assert type(got) is type(want), path
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same_numbers(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_numbers(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (path, got, want)
    else:
        assert got == want, path


def test_committed_learning_rate_transfer():
    """experiments/results/mup_transfer.json: its analysis is what ``analyse`` gives on its own rows, and it says
    what docs/scaling-laws.md says: under SP the best rate falls with width (the per-seed slopes' interval below
    −1 log₂η per doubling), under μP its interval holds 0, and the two differ (Welch p < 0.01)."""
    import importlib
    from pathlib import Path

    transfer = importlib.import_module("experiments.mup_transfer")
    saved = json.loads((Path(__file__).parents[1] / "experiments" / "results" / "mup_transfer.json").read_text())
    settings, rows = saved["settings"], saved["rows"]
    assert len(rows) == 2 * len(settings["widths"]) * len(settings["lrs"]) * settings["seeds"] == 168
    again = json.loads(json.dumps(transfer.analyse(rows, settings["widths"], settings["lrs"], settings["seeds"])))
    assert_same_numbers(again, saved["result"])
    sp, mu = saved["result"]["sp"]["shift_summary"], saved["result"]["mup"]["shift_summary"]
    assert sp["ci95"][1] < -1.0 and mu["ci95"][0] < 0.0 < mu["ci95"][1]
    assert saved["result"]["sp_minus_mup"]["p_value"] < 0.01
    assert not any(w["at_edge"] for p in ("sp", "mup") for w in saved["result"][p]["per_width"].values())
