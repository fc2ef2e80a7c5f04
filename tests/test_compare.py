"""Comparisons over seeds (mlx_llm.stats, ``mlx-llm compare``) and the seeds that separate the sources of noise
(``--init-seed``, ``--data-seed``)."""

import json
import math
import re

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


# ----- what compare refuses, on runs written as mlx-llm train writes them (no training) -----------------------------
FP = "ab" * 32  # a data fingerprint (DataSpec.fingerprint)


def written_run(root, name, value, *, steps=4, last=4, fingerprint=FP, data="/corpus", **train):
    """A run directory as ``mlx-llm train`` leaves it (configs, run.json with a new run id, metrics.jsonl, the
    checkpoint directories), without training: ``value`` its last val_bpb, ``last`` its last checkpoint."""
    from mlx_llm.runs.configs import DataSpec
    from mlx_llm.runs.record import RunRecord, write_run

    out = root / name
    write_run(out, TINY, tiny_train(steps=steps, **train),
              RunRecord(kind="pretrain", data=DataSpec(path=data, tokenizer="byte", fingerprint=fingerprint)))
    (out / "metrics.jsonl").write_text(json.dumps({"step": last, "loss": 2.0}) + "\n"
                                       + json.dumps({"step": last, "val_bpb": value}) + "\n")
    (out / "checkpoints" / str(last)).mkdir(parents=True)
    return out


def refusal(*args) -> str:
    """The one stderr line of a refused ``mlx-llm compare``."""
    proc = cli_in_process("compare", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_paired_matches_the_whole_seed_triple(tmp_path):
    """--paired pairs runs whose --seed, --init-seed and --data-seed all match (the seeds that vary within a group
    are the key): runs that differ in --data-seed no longer pair by --seed alone; an init-only study (one --seed,
    init seeds 0-2) pairs by its init seeds; a study of one seed (init 0 against init 1 over seeds 0-2, nothing
    else different) pairs by the others, and the same with a setting that differs too is refused; nothing is
    written."""
    a = [written_run(tmp_path, f"a{s}", 1.40 + 0.01 * s, seed=s) for s in range(3)]
    b9 = [written_run(tmp_path, f"b{s}", 1.45 + 0.02 * s, seed=s, data_seed=9) for s in range(3)]
    ia = [written_run(tmp_path, f"ia{i}", [1.41, 1.39, 1.44][i], init_seed=i) for i in range(3)]
    ib = [written_run(tmp_path, f"ib{i}", [1.46, 1.43, 1.47][i], init_seed=i) for i in (2, 0, 1)]
    i0 = [written_run(tmp_path, f"i0s{s}", 1.40 + 0.01 * s, seed=s, init_seed=0) for s in range(3)]
    i1 = [written_run(tmp_path, f"i1s{s}", [1.43, 1.47, 1.45][s], seed=s, init_seed=1) for s in range(3)]
    lr = [written_run(tmp_path, f"lr{s}", 1.5, seed=s, init_seed=1, lr=3e-3) for s in range(3)]
    before = snapshot(tmp_path)
    assert re.search(r"--paired: run .*a0 \(seed 0\) has no run with its seeds in --against: pairs share --seed and "
                     r"--init-seed and --data-seed", refusal(*a, "--against", *b9, "--paired"))
    assert re.search(r"run .*a0 \(seed 0\) has no run", refusal(*a, "--against", *i1, "--paired"))
    out = compare(ia, ib, paired=True)
    assert out["paired_by"] == ["init_seed"] and out["varied_seed"] is None
    assert out["b"]["runs"] == [str(tmp_path / f"ib{i}") for i in range(3)]
    want = sp.ttest_rel([1.41, 1.39, 1.44], [1.46, 1.43, 1.47])
    assert out["difference"]["p_value"] == pytest.approx(want.pvalue, rel=1e-9)
    out = compare(i0, i1, paired=True)
    assert (out["paired_by"], out["varied_seed"]) == (["seed", "data_seed"], "init_seed")
    want = sp.ttest_rel([1.40, 1.41, 1.42], [1.43, 1.47, 1.45])
    assert out["difference"]["p_value"] == pytest.approx(want.pvalue, rel=1e-9)
    text = cli_in_process("compare", *i0, "--against", *i1, "--paired").stdout
    assert "paired by --seed, --data-seed; the groups differ in --init-seed" in text
    assert re.search(r"the groups differ in --init-seed \(0 against 1\) and in their settings \(train.lr\)",
                     refusal(*i0, "--against", *lr, "--paired"))
    assert snapshot(tmp_path) == before


def test_one_run_counts_once(tmp_path):
    """A run given twice, through a symlink, or as a copy of its directory (the same run id) is refused, not
    counted as n = 3; a new run (its own id) of the same settings is another run."""
    import shutil

    a = [written_run(tmp_path, f"a{s}", 1.40 + 0.01 * s, seed=s) for s in range(2)]
    b = [written_run(tmp_path, f"b{s}", 1.45 + 0.01 * s, seed=s) for s in range(2)]
    (tmp_path / "link").symlink_to(a[0])
    shutil.copytree(a[0], tmp_path / "copy")
    before = snapshot(tmp_path)
    for again, how in ((a[0], "the same directory"), (tmp_path / "link", "the same directory"),
                       (tmp_path / "copy", "a copy of it \\(the same run id [0-9a-f]+\\)")):
        assert re.search(rf"run {again} is {a[0]} again, {how}: each run counts once",
                         refusal(*a[::-1], again, "--against", *b)), again
    assert re.search(r"is .*b0 again", refusal(*a, "--against", *b, b[0]))
    assert snapshot(tmp_path) == before
    assert compare(a + [written_run(tmp_path, "a2", 1.42, seed=2)], b)["a"]["n"] == 3


def test_unfinished_runs_are_refused_unless_allowed(tmp_path):
    """A run whose last checkpoint is short of its steps, or whose run lock another process holds (it is training
    now), is refused by name; --allow-unfinished compares the values the runs hold now and says at which step each
    was read. A run whose command ended there on purpose (a time limit: its summary.json ends at its last
    checkpoint) is finished, unless it was extended since."""
    from mlx_llm.runs.rundir import run_lock

    a = [written_run(tmp_path, "a0", 1.40), written_run(tmp_path, "a1", 1.42, seed=1, steps=6, last=2)]
    b = [written_run(tmp_path, f"b{s}", 1.45 + 0.01 * s, seed=s) for s in range(2)]
    c = [written_run(tmp_path, f"c{s}", 1.47, seed=s) for s in range(2)]
    before = snapshot(tmp_path)
    assert re.search(r"run .*a1 is unfinished \(its last checkpoint is step 2 of its 6 steps\): compare finished "
                     r"runs, or give --allow-unfinished", refusal(*a, "--against", *b))
    out = compare(a, b, allow_unfinished=True)
    assert out["a"]["steps"] == [4, 2] and out["b"]["steps"] == [4, 4] and out["a"]["mean"] == pytest.approx(1.41)
    assert out["unfinished"] == {str(a[1]): "its last checkpoint is step 2 of its 6 steps"}
    text = cli_in_process("compare", *a, "--against", *b, "--allow-unfinished").stdout
    assert f"{a[1]}: read at step 2 (unfinished: its last checkpoint is step 2 of its 6 steps)" in text
    assert f"{a[0]}: read at step 4\n" in text
    with run_lock(b[1]):  # another open file holds the lock, as a training process would
        assert re.search(r"run .*b1 is unfinished \(it is training now", refusal(*b, "--against", *c))
    assert snapshot(tmp_path) == {**before, "b1/run.lock": snapshot(b[1])["run.lock"]}
    (a[1] / "summary.json").write_text(json.dumps({"steps": 2, "val_bpb": 1.42}))  # ended by max_seconds at step 2
    assert compare(a, b)["a"]["steps"] == [4, 2]
    record = json.loads((a[1] / "run.json").read_text())
    (a[1] / "run.json").write_text(json.dumps({**record, "schedule_steps": 2}))  # then extended to 6 steps
    assert re.search(r"run .*a1 is unfinished \(its last checkpoint is step 2 of its 6", refusal(*a, "--against", *b))


def test_read_errors_and_overflow_are_one_line_or_null(tmp_path):
    """A byte that is not UTF-8 in metrics.jsonl is one line naming the file and line, not a traceback; values near
    the float range give statistics that overflow, and --json prints them as null (valid JSON, no Infinity)."""
    a = [written_run(tmp_path, f"a{s}", 1.4, seed=s) for s in range(2)]
    b = [written_run(tmp_path, f"b{s}", v, seed=s) for s, v in enumerate([1e308, -1e308])]
    with open(a[1] / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 5, "val_bpb": "\xff"}\n')
    assert re.search(rf"{a[1] / 'metrics.jsonl'}:3 cannot be read \(not UTF-8 text: byte 0xff", refusal(*a, "--against", *b))
    a[1] = written_run(tmp_path, "a2", 1.5, seed=1)
    huge = [written_run(tmp_path, f"h{s}", 1e308, seed=s) for s in range(2)]
    outs = []
    for group in (b, huge):
        proc = cli_in_process("compare", *a, "--against", *group, "--json")
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # no warning per overflowing operation
        outs.append(json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")))
    assert outs[0]["b"]["mean"] == 0.0 and outs[0]["b"]["std"] is None and outs[0]["b"]["ci95"] == [None, None]
    assert outs[0]["difference"]["mean"] == pytest.approx(1.45) and outs[0]["difference"]["ci95"] == [None, None]
    assert outs[1]["b"]["mean"] is None and outs[1]["difference"]["mean"] is None  # 1e308 + 1e308 overflows
    assert outs[1]["a"]["mean"] == pytest.approx(1.45) and outs[1]["difference"]["p_value"] is None


def test_no_spread_has_one_documented_rule():
    """Zero variance (every value of a group equal, or every paired difference equal, to within float rounding):
    the interval is the point and p is 0 for a difference, 1 for none, flagged, in a group, Welch's test and the
    paired test alike; differences equal only after rounding (1.4 - 1.3 and 1.3 - 1.2) follow the same rule."""
    d = stats.paired([1.3, 1.4], [1.2, 1.3])
    assert d.zero_variance and d.p_value == 0.0 and d.ci95 == (d.mean, d.mean) and d.mean == pytest.approx(0.1)
    assert "no spread between pairs: p is 0 by convention; significant" in stats.verdict(d)
    w = stats.welch([1.5, 1.5], [1.2, 1.2])
    assert (w.zero_variance, w.p_value, w.ci95) == (True, 0.0, (w.mean, w.mean))
    same = stats.paired([1.3, 1.4], [1.3, 1.4])
    assert (same.zero_variance, same.p_value, same.significant) == (True, 1.0, False)
    assert stats.welch([0.1 + 0.2, 0.3], [0.3, 0.3]).p_value == 1.0  # equal after rounding: no difference
    flat = stats.summarize([0.1 + 0.2, 0.3])
    assert flat.std == 0.0 and flat.ci95 == (flat.mean, flat.mean) and flat.mean == pytest.approx(0.3)
    spread = stats.paired([1.3, 1.5], [1.2, 1.3])
    assert not spread.zero_variance and "zero_variance" not in spread.as_dict() and 0 < spread.p_value < 1


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
