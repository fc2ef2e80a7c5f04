"""Comparisons over seeds (mlx_llm.stats, ``mlx-llm compare``) and the seeds that separate the sources of noise
(``--init-seed``, ``--data-seed``)."""

import json
import math

import jax
import numpy as np
import pytest
from scipy import stats as sp

from helpers import TINY, cli_in_process, snapshot, spec_for, tiny_train
from mlx_llm import stats
from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.eval.compare import compare

A = [1.412, 1.398, 1.431, 1.405, 1.420]
B = [1.452, 1.447, 1.466, 1.439]


# ----- the statistics, by hand ------------------------------------------------------------------------------------
def test_summary_is_the_t_interval_written_out():
    s = stats.summarize(A)
    n, mean = len(A), sum(A) / len(A)
    sd = math.sqrt(sum((x - mean) ** 2 for x in A) / (n - 1))
    half = sp.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert s.n == n and s.mean == pytest.approx(mean, abs=1e-15) and s.std == pytest.approx(sd, rel=1e-12)
    assert s.ci95 == pytest.approx((mean - half, mean + half), rel=1e-12)
    assert stats.describe(s) == f"{mean:.4f} ± {half:.4f} (n = 5)"


def test_welch_is_the_formula_written_out():
    d = stats.welch(A, B)
    va, vb = np.var(A, ddof=1) / len(A), np.var(B, ddof=1) / len(B)
    diff = np.mean(A) - np.mean(B)
    df = (va + vb) ** 2 / (va ** 2 / (len(A) - 1) + vb ** 2 / (len(B) - 1))  # Welch–Satterthwaite
    t = diff / math.sqrt(va + vb)
    half = sp.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert d.test == "welch" and d.mean == pytest.approx(diff, abs=1e-15)
    assert d.p_value == pytest.approx(2 * sp.t.sf(abs(t), df), rel=1e-9)
    assert d.ci95 == pytest.approx((diff - half, diff + half), rel=1e-9)
    assert d.significant and "significant at p < 0.05" in stats.verdict(d) and "not" not in stats.verdict(d)


def test_paired_is_the_one_sample_test_of_the_differences():
    a, b = A[:4], [1.410, 1.401, 1.425, 1.409]
    d = stats.paired(a, b)
    diffs = np.subtract(a, b)
    se = np.std(diffs, ddof=1) / math.sqrt(len(diffs))
    t = diffs.mean() / se
    assert d.test == "paired" and d.p_value == pytest.approx(2 * sp.t.sf(abs(t), len(diffs) - 1), rel=1e-9)
    half = sp.t.ppf(0.975, len(diffs) - 1) * se
    assert d.ci95 == pytest.approx((diffs.mean() - half, diffs.mean() + half), rel=1e-9)
    assert not d.significant and "not significant" in stats.verdict(d)


def test_main_job_seeds_against_a_committed_file_pairs_by_seed(tmp_path, monkeypatch):
    """``experiments.main_job_seeds --against NAME``: these runs minus a committed results file's, paired over the
    seeds both have; a missing file, another script's file and fewer than two shared seeds are refused in one
    line."""
    from experiments import common, main_job_seeds as mjs

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / "old.json").write_text(json.dumps({"runs": [{"seed": 0, "val_bpb": 1.5}, {"seed": 1, "val_bpb": 1.6},
                                                            {"seed": 2, "val_bpb": 1.42}]}))
    rows = [{"seed": 0, "val_bpb": 1.4}, {"seed": 1, "val_bpb": 1.45}, {"seed": 2, "val_bpb": 1.41},
            {"seed": 3, "val_bpb": 9.0}]
    got = mjs.paired_against(rows, mjs.against_runs("old"), "old")
    want = sp.ttest_rel([1.4, 1.45, 1.41], [1.5, 1.6, 1.42])
    assert got["seeds"] == [0, 1, 2] and got["difference"]["test"] == "paired"
    assert got["difference"]["mean"] == pytest.approx(-0.26 / 3, abs=1e-12)
    assert got["difference"]["p_value"] == pytest.approx(want.pvalue, rel=1e-9)
    assert got["other"]["mean"] == pytest.approx(4.52 / 3) and "not significant" in got["verdict"]
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"arm": "a"}]}))
    for name, message in (("missing", "there is no"), ("other", "not a results file of this script")):
        with pytest.raises(SystemExit, match=message):
            mjs.against_runs(name)
    with pytest.raises(SystemExit, match="shares 1 seed"):
        mjs.paired_against(rows[3:] + rows[:1], mjs.against_runs("old"), "old")


def test_main_job_seeds_recipes_reach_mlx_llm_train_and_read_back_only_their_own_runs(tmp_path, monkeypatch):
    """``experiments.main_job_seeds --recipe``: each recipe the main job grew out of reaches ``mlx-llm train`` as the
    ``--set`` items and ``--steps`` that turn its defaults into that recipe (the main job: none), a user's ``--set``
    on top replacing the recipe's value of the same field; runs of another recipe or settings need ``--save`` (a
    refused command writes nothing); a finished run read back must have trained those settings."""
    import dataclasses

    from experiments import common, main_job_seeds as mjs
    from mlx_llm.recipes import ADAMW_TRAIN, BASE_MODEL, MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MUON_TRAIN

    assert mjs.with_recipe("main_job", [], None) == ([], None)
    for name, (cfg, tcfg) in mjs.RECIPES.items():
        sets, steps = mjs.with_recipe(name, [], None)
        assert mjs.run_configs(3, steps, sets) == (cfg, dataclasses.replace(tcfg, seed=3)), name
    assert (BASE_MODEL, MUON_TRAIN.steps, ADAMW_TRAIN.optimizer) == (mjs.RECIPES["adamw"][0], 700, "adamw")
    sets, steps = mjs.with_recipe("adamw", ["train.lr=0.002", "model.embed_scale=true"], 300)
    assert steps == 300 and "train.lr=0.002" in sets and "train.lr=0.005" not in sets
    cfg, tcfg = mjs.run_configs(0, steps, sets)
    assert (tcfg.lr, tcfg.steps, tcfg.optimizer, cfg.embed_scale, cfg.sandwich_norm) == (0.002, 300, "adamw", True,
                                                                                        False)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    for argv in (["--recipe", "muon"], ["--set", "train.lr=0.02"], ["--steps", "40"]):
        with pytest.raises(SystemExit, match=r"give --save NAME for runs of another recipe or settings"):
            mjs.main(["--out", str(tmp_path / "runs"), *argv])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()
    run = tmp_path / "runs" / "seed0"  # a finished run of the main job, read back by the muon recipe: refused
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(MAIN_JOB_MODEL.to_dict()))
    (run / "train_config.json").write_text(json.dumps(dataclasses.asdict(MAIN_JOB_TRAIN)))
    (run / "summary.json").write_text(json.dumps({"val_bpb": 1.3, "val_loss": 2.3, "steps": 644,
                                                  "train_seconds": 1.0}))
    assert mjs.run_seed(0, tmp_path / "runs", tmp_path / "cache", None)["val_bpb"] == 1.3
    with pytest.raises(SystemExit, match="holds a run of other settings"):
        mjs.run_seed(0, tmp_path / "runs", tmp_path / "cache", *mjs.with_recipe("muon", [], None)[::-1])


@pytest.mark.parametrize("values, message", [([1.0], r"has 1 value\(s\): a mean's interval needs at least two"),
                                             ([1.0, float("nan")], r"not finite")])
def test_a_group_needs_two_finite_values(values, message):
    with pytest.raises(InputError, match=message):
        stats.summarize(values)


# ----- seeds ------------------------------------------------------------------------------------------------------
def test_init_and_data_seeds_each_move_one_source_of_noise(corpus_dir, tmp_path):
    """Two configs that differ only in --data-seed start from the same parameters and see other batches; two that
    differ only in --init-seed see the same batches from other parameters; unset, both are --seed's (today's)."""
    from mlx_llm.data.corpora import open_data
    from mlx_llm.train.step import init_state, optimizer_for

    base = tiny_train()
    corpus = open_data(tmp_path, spec_for(corpus_dir)).build(tmp_path / "cache")

    def params(t):
        return init_state(TINY, t, optimizer_for(t)).params

    def batch(t):
        return corpus.train_batch(0, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.batch_seed)["tokens"]

    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa
    data1, data2 = tiny_train(data_seed=1), tiny_train(data_seed=2)
    assert same(params(data1), params(data2)) and same(params(data1), params(base))
    assert not np.array_equal(batch(data1), batch(data2))
    init1, init2 = tiny_train(init_seed=1), tiny_train(init_seed=2)
    assert np.array_equal(batch(init1), batch(init2)) and np.array_equal(batch(init1), batch(base))
    assert not same(params(init1), params(init2))
    assert (base.params_seed, base.batch_seed, tiny_train(seed=7, data_seed=3).batch_seed) == (0, 0, 3)
    with pytest.raises(ConfigError, match=r"TrainConfig.init_seed = -1 is invalid"):
        TrainConfig(init_seed=-1)


# ----- mlx-llm compare on runs mlx-llm train wrote ------------------------------------------------------------------
@pytest.fixture(scope="module")
def four_runs(corpus_dir, tmp_path_factory):
    """Two learning rates × two seeds of the tiny model (4 steps each), and a fifth run on another val split."""
    root = tmp_path_factory.mktemp("compare")
    (root / "model.json").write_text(json.dumps(TINY.to_dict()))
    common = ["--data", corpus_dir, "--extensions", ".py", "--tokenizer", "byte", "--config", root / "model.json",
              "--steps", 4, "--warmup-steps", 1, "--batch-size", 4, "--seq-len", 32, "--eval-interval", 4,
              "--eval-tokens", 256, "--checkpoint-interval", 4, "--no-progress", "--sample-tokens", 2,
              "--cache-dir", root / "cache"]
    runs = {}
    for lr in ("1e-2", "3e-3"):
        for seed in (0, 1, 2):
            out = root / f"lr{lr}-s{seed}"
            proc = cli_in_process("train", *common, "--val-percent", 20, "--lr", lr, "--seed", seed, "--out", out)
            assert proc.returncode == 0, proc.stderr
            runs[(lr, seed)] = out
    other = root / "other-val"
    assert cli_in_process("train", *common, "--val-percent", 40, "--out", other).returncode == 0
    return runs, other


@pytest.mark.slow
def test_compare_matches_scipy_on_real_runs(four_runs):
    runs, _ = four_runs
    a = [runs[("1e-2", s)] for s in (0, 1, 2)]
    b = [runs[("3e-3", s)] for s in (2, 0, 1)]  # another order: --paired matches them by seed
    va = [json.loads((r / "summary.json").read_text())["val_bpb"] for r in a]
    vb = [json.loads((r / "summary.json").read_text())["val_bpb"] for r in b]
    out = compare(a, b)
    welch = sp.ttest_ind(va, vb, equal_var=False)
    assert out["metric"] == "val_bpb" and out["a"]["runs"] == [str(r) for r in a] and out["a"]["n"] == 3
    assert out["a"]["mean"] == pytest.approx(np.mean(va), abs=1e-12)
    assert out["a"]["std"] == pytest.approx(np.std(va, ddof=1), rel=1e-9)
    interval = sp.t.interval(0.95, 2, loc=np.mean(va), scale=np.std(va, ddof=1) / math.sqrt(3))
    assert out["a"]["ci95"] == pytest.approx(list(interval), rel=1e-9)
    assert out["difference"]["p_value"] == pytest.approx(welch.pvalue, rel=1e-9)
    assert out["difference"]["ci95"] == pytest.approx(list(welch.confidence_interval(0.95)), rel=1e-9)
    by_seed = {json.loads((r / "train_config.json").read_text())["seed"]: v for r, v in zip(b, vb)}
    paired = compare(a, b, paired=True)
    rel = sp.ttest_rel(va, [by_seed[s] for s in (0, 1, 2)])
    assert paired["difference"]["test"] == "paired"
    assert paired["difference"]["p_value"] == pytest.approx(rel.pvalue, rel=1e-9)
    assert paired["difference"]["ci95"] == pytest.approx(list(rel.confidence_interval(0.95)), rel=1e-9)
    assert paired["b"]["runs"] == [str(runs[("3e-3", s)]) for s in (0, 1, 2)]
    loss = compare(a, b, "val_loss")
    assert loss["metric"] == "val_loss" and loss["a"]["n"] == 3
    proc = cli_in_process("compare", *a, "--against", *b, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == out  # exactly one JSON object
    text = cli_in_process("compare", *a, "--against", *b).stdout
    assert text.startswith("val_bpb:") and "difference" in text and "(n = 3)" in text


@pytest.mark.slow
def test_compare_refusals_are_one_line_and_write_nothing(four_runs):
    runs, other = four_runs
    a = [runs[("1e-2", s)] for s in (0, 1, 2)]
    b = [runs[("3e-3", s)] for s in (0, 1, 2)]
    before = {r: snapshot(r) for r in [*a, *b, other]}
    cases = [((a[0], "--against", *b), r"the first group has 1 run\(s\): a mean's interval needs at least two"),
             ((*a, "--against", *b, "--metric", "val_nope"), r"records no 'val_nope'"),
             ((*a, "--against", b[0], other), rf"run {other} measured its metric on other validation data .*"
                                                r"val_percent differ"),
             ((*a[:2], "--against", *b[1:], "--paired"), r"--paired: run .*s0 \(seed 0\) has no run with its seed"),
             ((*a, a[0], "--against", *b, "--paired"), r"seed 0 is used by more than one run")]
    import re

    for args, message in cases:
        proc = cli_in_process("compare", *args)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("mlx-llm")]
        assert proc.returncode == 2 and len(lines) == 1 and re.search(message, lines[0]), (args, proc.stderr)
    assert {r: snapshot(r) for r in [*a, *b, other]} == before


@pytest.mark.slow
def test_a_changed_seed_on_resume_is_refused(four_runs):
    runs, _ = four_runs
    run = runs[("1e-2", 0)]
    before = snapshot(run)
    for flag in ("--seed", "--init-seed", "--data-seed"):
        proc = cli_in_process("train", "--resume", "--out", run, flag, 5, "--no-progress")
        assert proc.returncode == 2 and "exactly as it was configured" in proc.stderr, proc.stderr
    assert snapshot(run) == before


def test_knobs_main_arms_reach_mlx_llm_train_as_their_settings(tmp_path, monkeypatch):
    """``experiments.knobs_main``: each arm's ``--set`` items, parsed as ``mlx-llm train`` parses them, rebuild the
    arm's configs exactly (at the main job's steps and at fewer, warmups scaled); a step within ±5 % of the main
    job's trains its 700 steps, a dearer one the steps of the same time; an unknown arm and an untimed one are
    refused in one line."""
    import dataclasses

    from experiments import common, knobs_main as km
    from mlx_llm.cli.flags import apply_sets
    from mlx_llm.config import ModelConfig
    from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN

    sections = {"model": ("model", ModelConfig), "train": ("train", TrainConfig)}
    assert "muon" not in km.ARMS and {"mtp", "normuon", "window_warmup", "relu2"} <= set(km.ARMS)
    for arm in km.ARMS:
        for steps in (700, 583):
            fields = apply_sets({}, km.settings(arm, steps), sections)
            cfg = dataclasses.replace(MAIN_JOB_MODEL, **fields.get("model", {}))
            tcfg = dataclasses.replace(MAIN_JOB_TRAIN, steps=steps, **fields.get("train", {}))
            assert (cfg, tcfg) == km.configs(arm, steps), (arm, steps)
    # the arms are the Muon recipe's (no sandwich norms, no value embeddings, Muon, 700 steps, warmup 30), knob on;
    # their --set items say what differs from mlx-llm train's defaults, today's main job
    assert km.settings("mtp", 583) == ["model.value_embeds=false", "model.sandwich_norm=false", "model.mtp_depth=1",
                                       "train.warmup_steps=25", "train.optimizer=muon"]
    assert "model.window_warmup_steps=292" in km.settings("window_warmup", 583)
    assert km.settings("normuon", 700) == ["model.value_embeds=false", "model.sandwich_norm=false",
                                           "train.warmup_steps=30"]  # NorMuon at Muon's lr is the default's
    assert [km.steps_for(r) for r in (0.96, 1.04, 1.051, 1.2, 0.8)] == [700, 700, 666, 583, 875]
    with pytest.raises(SystemExit, match="arm 'muon' is unknown"):
        km.overrides("muon")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / f"{km.TIMING}.json").write_text(json.dumps({"arms": {"mtp": {"steps": 583}}}))
    assert km.timed_steps("mtp") == 583
    with pytest.raises(SystemExit, match="arm 'relu2' has no step timing"):
        km.timed_steps("relu2")


def test_knobs_main_combinations_timing_merge_and_stale_runs(tmp_path, monkeypatch):
    """``experiments.knobs_main``: an arm "a+b" is the two arms' settings together (an unknown part refused in one
    line); a later timing adds its arms to the saved one, each new row keeping the main job's seconds it was timed
    against, the arms timed before untouched; a run read back that trained other than its arm's timed steps is
    refused in one line (``common.finished_run``), not compared; one timing batch for recipes of different shapes
    is refused."""
    import dataclasses

    from experiments import common, knobs_main as km
    from mlx_llm.recipes import MAIN_JOB_TRAIN

    combo = "sandwich_norm+value_embeds+normuon"
    assert km.overrides(combo) == ({"sandwich_norm": True, "value_embeds": True}, {"optimizer": "normuon"})
    assert km.settings(combo, 640) == []  # at its timed steps, the combination is today's main job
    assert km.settings("sandwich_norm+value_embeds", 644) == ["train.warmup_steps=28", "train.optimizer=muon"]
    with pytest.raises(SystemExit, match="arm 'sandwich' is unknown"):
        km.overrides("sandwich+value_embeds")
    old = {"main_job_seconds": 0.30, "rounds": 15, "tolerance": 0.05,
           "arms": {"mtp": {"seconds": 0.375, "ratio": 1.25, "steps": 560}}}
    new = {"main_job_seconds": 0.32, "rounds": 30, "tolerance": 0.05,
           "arms": {combo: {"seconds": 0.352, "ratio": 1.1, "steps": 636}}}
    merged = km.merged_timing(new, old)
    assert merged["main_job_seconds"] == 0.30 and merged["arms"]["mtp"] == old["arms"]["mtp"]
    assert merged["arms"][combo] == {"seconds": 0.352, "ratio": 1.1, "steps": 636, "main_job_seconds": 0.32,
                                     "rounds": 30}
    assert old["arms"].keys() == {"mtp"} and km.merged_timing(new, None) is new
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / f"{km.TIMING}.json").write_text(json.dumps(merged))
    for seed in (0, 1):  # seed 1 trained before a new timing changed the arm's steps
        run = tmp_path / "runs" / combo / f"seed{seed}"
        run.mkdir(parents=True)
        cfg, tcfg = km.configs(combo, 636 if seed == 0 else 700)
        (run / "config.json").write_text(json.dumps(cfg.to_dict()))
        (run / "train_config.json").write_text(json.dumps(dataclasses.asdict(dataclasses.replace(tcfg, seed=seed))))
        (run / "summary.json").write_text(json.dumps({"val_bpb": 1.3, "val_loss": 2.3, "steps": tcfg.steps,
                                                      "train_seconds": 200.0}))
    with pytest.raises(SystemExit, match=r"seed1 holds a run of other settings \(steps=700, warmup_steps=30; this "
                                         r"run wants steps=636, warmup_steps=27\)"):
        km.run_arm(combo, 2, tmp_path / "runs", tmp_path / "cache", {0: 1.4, 1: 1.4})
    with pytest.raises(ValueError, match="disagree on \\(batch_size, seq_len, mesh\\)"):
        common.interleaved_step_times({"a": (None, MAIN_JOB_TRAIN),
                                       "b": (None, dataclasses.replace(MAIN_JOB_TRAIN, seq_len=64))}, 1, tmp_path)
