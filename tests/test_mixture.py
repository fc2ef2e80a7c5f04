"""Weighted data mixtures (issue 25): --data NAME=PATH[:WEIGHT] ... or a mixture JSON; rows drawn in proportion
to the weights as a function of (seed, step); validation per source and as the weighted mean; resume bitwise;
bad weights and names refused in one line."""

import json
import math
import shutil

import jax
import numpy as np
import pytest

from mlx_llm.errors import ConfigError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.data.corpora import open_data
from mlx_llm.data.mixture import data_flag, parse_source, parse_sources, read_mixture_file
from mlx_llm.train.trackers import TB_DIR
from helpers import assert_trees_equal, cli_in_process, snapshot


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two text sources whose documents are told apart by their letters: a (only 'a b c') and b (only 'x y z')."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    for name, letters in (("a", "abc"), ("b", "xyz")):
        (root / name).mkdir()
        for i in range(10):
            words = [" ".join(rng.choice(list(letters), size=6)) for _ in range(40)]
            (root / name / f"doc{i}.txt").write_text("\n".join(words) + "\n")
    return root


def spec(sources, weights=(3, 1)):
    return DataSpec(**data_flag([f"a={sources / 'a'}:{weights[0]}", f"b={sources / 'b'}:{weights[1]}"]),
                    tokenizer="byte", val_percent=20.0)


def test_sources_parse_with_weights_defaults_and_colons(tmp_path):
    s = parse_source("web=data/a:b.jsonl:2.5", tmp_path)
    assert (s.name, s.path, s.weight) == ("web", str(tmp_path / "data" / "a:b.jsonl"), 2.5)
    assert parse_source("code=/x/y.txt").weight == 1.0
    assert parse_sources([s.spec()]) == (s,)  # the canonical spec stored in run.json reads back the same
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "a", "path": "a.txt", "weight": 3},
                                                               {"name": "b", "path": "/abs/b.txt"}]}))
    a, b = read_mixture_file(tmp_path / "mix.json")
    assert (a.path, a.weight, b.path, b.weight) == (str(tmp_path / "a.txt"), 3.0, "/abs/b.txt", 1.0)
    fields = data_flag([str(tmp_path / "mix.json")])
    assert fields["path"] is None and len(fields["mixture"]) == 2
    assert data_flag(["plain/dir"]) == {"path": "plain/dir"}


@pytest.mark.parametrize("items, message", [
    (["a=x:0"], "the weight 0 of source 'a' is invalid: weights must be positive"),
    (["a=x:-2"], "the weight -2 of source 'a' is invalid"),
    (["a=x:nan"], "the weight nan of source 'a' is invalid"),
    (["a=x", "a=y"], r"\['a'\] are given more than once"),
    (["bad name=x"], "NAME=PATH"),
    (["=x"], "NAME=PATH"),
    (["a=x", "plain"], "every one named"),
])
def test_bad_sources_are_refused_in_one_line(items, message):
    with pytest.raises(ConfigError, match=message) as err:
        data_flag(items)
    assert "\n" not in str(err.value)


def test_a_bad_mixture_file_is_refused(tmp_path):
    for body, message in (("{", "cannot be read"), ('{"sources": []}', "at least one source"),
                          ('{"sources": [{"name": "a"}]}', "needs 'name' and 'path'"),
                          ('{"sources": [{"name": "a", "path": "p", "weight": "3"}]}', "is not a number"),
                          ('{"sources": [{"name": "a", "path": "p", "weight": 0}]}', "must be positive")):
        (tmp_path / "m.json").write_text(body)
        with pytest.raises(ConfigError, match=message):
            read_mixture_file(tmp_path / "m.json")


def test_rows_are_drawn_three_to_one_and_hold_their_sources_text(tmp_path, sources):
    data = open_data(tmp_path, spec(sources))
    corpus = data.build(tmp_path / "cache")
    drawn = np.concatenate([corpus.row_sources(step, 8, seed=0) for step in range(500)])
    assert abs(np.mean(drawn == 0) - 0.75) < 0.02  # 4000 rows: 3:1 within ~3 standard deviations
    for step in range(3):
        batch, src = corpus.train_batch(step, batch_size=8, seq_len=24, seed=0), corpus.row_sources(step, 8, 0)
        for row, k in enumerate(src):
            text = set(data.tokenizer.decode(batch["tokens"][row], skip_special=True)) - set(" \n")
            assert text <= set("abc" if k == 0 else "xyz") and text
        half = corpus.train_batch(step, batch_size=8, seq_len=24, seed=0, rows=slice(4, 8))
        np.testing.assert_array_equal(half["tokens"], batch["tokens"][4:])  # a process's rows of the same batch
    assert not np.array_equal(corpus.row_sources(0, 8, 0), corpus.row_sources(0, 8, 1))


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, sources):
    out = tmp_path_factory.mktemp("mixrun") / "run"
    config = out.parent / "tiny.json"
    config.write_text(json.dumps({"vocab_size": 263, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                                  "d_head": 8, "d_ff": 32, "max_seq_len": 32}))
    flags = ("--data", f"a={sources / 'a'}:3", f"b={sources / 'b'}", "--tokenizer", "byte", "--val-percent", 20,
             "--config", config, "--steps", 6, "--warmup-steps", 1, "--seq-len", 24, "--batch-size", 4,
             "--eval-interval", 3, "--checkpoint-interval", 3, "--sample-tokens", 4, "--no-progress",
             "--cache-dir", out.parent / "cache", "--tracker", "tensorboard")
    res = cli_in_process("train", "--out", out, *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


@pytest.mark.slow
def test_validation_is_reported_per_source_and_as_the_weighted_mean(mixed_run):
    out, res = mixed_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert math.isclose(r["val_loss"], 0.75 * r["val_loss/a"] + 0.25 * r["val_loss/b"], rel_tol=1e-12)
        assert math.isclose(r["val_bpb"], 0.75 * r["val_bpb/a"] + 0.25 * r["val_bpb/b"], rel_tol=1e-12)
        assert math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-12)
    assert "source a: val loss" in res.stdout and "source b: val loss" in res.stdout
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(out / TB_DIR), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    for tag in ("val_bpb/a", "val_bpb/b", "val_loss/a", "val_bpb"):  # the trackers get every source too
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got == pytest.approx({r["step"]: r[tag] for r in evals}, rel=1e-6)
    record = json.loads((out / "run.json").read_text())["data"]
    assert record["path"] is None and [m.split("=")[0] for m in record["mixture"]] == ["a", "b"]
    ev = cli_in_process("eval", "--run", out, "--cache-dir", out.parent / "cache")
    assert ev.returncode == 0 and f"{evals[-1]['val_loss']:.4f}" in ev.stdout and "source b" in ev.stdout


@pytest.mark.slow
def test_a_mixture_resumes_bitwise_and_refuses_a_changed_mixture(tmp_path, mixed_run, sources):
    out, _ = mixed_run
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "checkpoints" / "6")
    res = cli_in_process("train", "--resume", "--out", cut, "--no-progress", "--sample-tokens", 4,
                         "--cache-dir", out.parent / "cache")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (cut / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    assert_trees_equal(jax.device_get(load_params(cut)), jax.device_get(load_params(out)))
    before = snapshot(tmp_path)
    res = cli_in_process("train", "--resume", "--out", cut, "--data", f"a={sources / 'a'}:1", f"b={sources / 'b'}")
    assert res.returncode == 2 and "mixture" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert snapshot(tmp_path) == before
