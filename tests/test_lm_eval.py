"""The lm-evaluation-harness model class (mlx_llm/eval/harness.py) over a tiny run, offline: the tasks are YAMLs over
JSONL files this test writes, and every number the harness reports is recomputed here from our own forward and
``sequence_log_likelihood`` (or ``generate``). Needs the ``eval`` extra (lm_eval)."""

import dataclasses
import importlib
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LazyModule, cli_in_process, snapshot

from mlx_llm.decode.generate import generate
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.model import forward
from mlx_llm.ops import token_nll
from mlx_llm.objectives.loss import sequence_log_likelihood
from mlx_llm.runs.configs import RewardConfig
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import BaseRef, open_run
from mlx_llm.data import tokenizer as tok_lib

# the eval extra, imported when a test runs (harness.py itself refuses to import without it)
lm_eval = LazyModule("lm_eval")
harness = LazyModule("mlx_llm.eval.harness")


def Instance(*args):  # noqa: N802  (lm_eval's class, imported when used)
    return LazyModule("lm_eval.api.instance").Instance(*args)


def TaskManager(**kw):  # noqa: N802
    return LazyModule("lm_eval.tasks").TaskManager(**kw)

MC = [{"question": f"x = {a} +", "choices": [str(b), str(b + 7), "x", str(a + 1)], "label": 3 * k % 4}
      for k, (a, b) in enumerate([(12, 34), (5, 61), (80, 2), (33, 33), (7, 90), (41, 18), (66, 5), (9, 9)])]
ROLL = [{"text": "x = 1 + 2\n"}, {"text": "".join(f"x = {i} + {i * 7 % 100}\n" for i in range(14))}]
GEN = [{"prompt": f"x = {a} + ", "answer": str(b)} for a, b in [(3, 4), (5, 12), (8, 77)]]  # prompts of one length

TASKS = {
    "mc_local": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
""",
    "roll_local": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "gen_local": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """Three task YAMLs over local JSONL files (``dataset_path: json``): no hub access."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in (("mc_local", MC), ("roll_local", ROLL), ("gen_local", GEN)):
        data = d / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (d / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {data}\ntest_split: test\n" + TASKS[name])
    return d


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def lm(base_run):
    return harness.MLXLM(base_run)


@pytest.fixture(scope="module")
def own(base_run):
    """Our own scoring, one sequence at a time: (params, cfg, tok, ll(seq, n) → (Σ log p of its last n tokens,
    whether each is the argmax)). The sequence is right-padded to max_seq_len + 1 (one compiled forward; a causal
    model's real positions never see the padding: ``test_own_scoring_is_the_unpadded_forward``)."""
    run = open_run(base_run)
    params, cfg, tok = load_params(run), run.cfg, tok_lib.load(run.path)
    fwd = jax.jit(forward, static_argnums=2)

    def ll(seq, n, *, pad=True):
        t = len(seq) - 1
        ids = np.asarray(seq + [tok.pad_id] * (cfg.max_seq_len + 1 - len(seq) if pad else 0), np.int32)[None]
        logits = fwd(params, ids[:, :-1], cfg)
        greedy = bool(np.all(np.asarray(jnp.argmax(logits, -1))[0, t - n:t] == ids[0, t - n + 1:t + 1]))
        per_token = -np.asarray(token_nll(logits[0, t - n:t], ids[0, t - n + 1:t + 1]), np.float64)
        return float(per_token.sum()), greedy  # float32 log-probs summed in float64, as the harness sums them

    ll([tok.bos_id, 120], 1)  # compiled once here, for every test of the module
    return params, cfg, tok, ll


def requests(kind, args):
    return [Instance(kind, {}, a, k) for k, a in enumerate(args)]


def own_pair(tok, context, continuation):
    """BOS + context, then the continuation (the byte tokenizer encodes text piecewise)."""
    return [tok.bos_id, *(tok.encode(context).tolist() if context else [])], tok.encode(continuation).tolist()


def own_rolling(ll, cfg, tok, text):
    """Σ log p of every token of ``text`` after BOS, computed here: the tokens in chunks of max_seq_len, each
    chunk given the max_seq_len tokens before its end (the first chunk: BOS and what precedes each token)."""
    full, L = [tok.bos_id, *tok.encode(text).tolist()], cfg.max_seq_len
    n, total, end = len(full) - 1, 0.0, 0
    while end < n:
        start, end = end, min(n, end + L)
        total += ll(full[max(0, end - L):end + 1], end - start)[0]  # inputs full[end-L:end], the last end-start scored
    return total


# ----- the model class, request by request --------------------------------------------------------------------
@pytest.mark.slow
def test_own_scoring_is_the_unpadded_forward(own):
    params, cfg, tok, ll = own
    ctx, cont = own_pair(tok, "x = 12 +", " 34")
    seq = jnp.asarray(ctx + cont)[None]
    mask = jnp.zeros(seq.shape[1] - 1).at[-len(cont):].set(1.0)[None]
    want = float(sequence_log_likelihood(forward(params, seq[:, :-1], cfg), seq[:, 1:], mask)[0])
    assert ll(ctx + cont, len(cont))[0] == pytest.approx(want, abs=1e-6)
    assert ll(ctx + cont, len(cont), pad=False)[0] == pytest.approx(want, abs=1e-6)


def test_loglikelihood_equals_our_own_scoring(lm, own):
    params, cfg, tok, ll = own
    args = [("x = 12 +", " 34"), ("x = 5 + ", "61"), ("", "x = 1"), ("x", " = 3 + 4\n")]
    got = lm.loglikelihood(requests("loglikelihood", args))
    for (context, continuation), (value, greedy) in zip(args, got):
        n_space = len(context) - len(context.rstrip())  # trailing whitespace moves to the continuation
        ctx, cont = own_pair(tok, context[:len(context) - n_space], context[len(context) - n_space:] + continuation)
        want, want_greedy = ll(ctx + cont, len(cont))
        assert value == pytest.approx(want, abs=1e-5)
        assert greedy == want_greedy
    assert lm.loglikelihood(requests("loglikelihood", [("x", "")])) == [(0.0, True)]


def test_is_greedy_is_true_for_the_argmax_continuation(lm, own):
    params, cfg, tok, ll = own
    ids = [tok.bos_id, *tok.encode("x = 1").tolist()]
    fwd = jax.jit(forward, static_argnums=2)
    for _ in range(3):  # extend by the model's own argmax: that continuation is greedy by definition
        padded = np.asarray(ids + [tok.pad_id] * (cfg.max_seq_len - len(ids)), np.int32)[None]
        ids.append(int(jnp.argmax(fwd(params, padded, cfg)[0, len(ids) - 1])))
    cont = tok.decode(np.asarray(ids[-3:]))
    assert lm.loglikelihood(requests("loglikelihood", [("x = 1", cont)]))[0][1] is True


def test_requests_longer_than_max_seq_len_keep_their_last_tokens(lm, own):
    params, cfg, tok, ll = own
    L = cfg.max_seq_len
    context, continuation = "x = 1 + 2\n" * 12 + "x", " = 4"
    ctx, cont = own_pair(tok, context, continuation)
    assert len(ctx) + len(cont) > L + 1
    (value, greedy), = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    assert value == pytest.approx(ll((ctx + cont)[-(L + 1):], len(cont))[0], abs=1e-5)
    with pytest.raises(InputError, match=f"longer than max_seq_len = {L}") as err:
        lm.loglikelihood(requests("loglikelihood", [("x", "y" * (L + 1))]))
    assert "\n" not in str(err.value)
    edge = "y" * L  # a continuation of exactly max_seq_len tokens keeps one context token
    assert lm.loglikelihood(requests("loglikelihood", [("x", edge)]))[0][0] == pytest.approx(
        ll([tok.encode("x").tolist()[-1], *tok.encode(edge).tolist()], L)[0], abs=1e-5)


def test_empty_context_without_bos_scores_from_eos():
    tok = tok_lib.ByteTokenizer(roles={"eos": tok_lib.EOS, "pad": tok_lib.PAD})
    assert tok.bos_id is None
    assert harness.encode_pair(tok, "", "ab") == ([tok.eos_id], [97, 98])
    assert harness.encode_pair(tok, "a ", "b") == ([97], [32, 98])


def test_loglikelihood_rolling_is_the_sum_of_per_token_log_probs(lm, own):
    params, cfg, tok, ll = own
    texts = [d["text"] for d in ROLL] + ["x" * (2 * cfg.max_seq_len)]
    assert len(tok.encode(texts[0])) < cfg.max_seq_len < len(tok.encode(texts[1]))
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    for text, value in zip(texts, got):
        assert value == pytest.approx(own_rolling(ll, cfg, tok, text), abs=1e-5)
    seq = [tok.bos_id, *tok.encode(texts[0]).tolist()]  # short: every token after BOS, in one window
    assert got[0] == pytest.approx(ll(seq, len(seq) - 1)[0], abs=1e-5)


@pytest.mark.slow
def test_generate_until_is_greedy_generate_cut_at_the_first_stop(lm, own):
    params, cfg, tok, _ = own
    contexts = [d["prompt"] for d in GEN]
    got = lm.generate_until(requests("generate_until", [(c, {"until": ["\n"], "max_gen_toks": 6}) for c in contexts]))
    for context, text in zip(contexts, got):
        ids = np.asarray([tok.bos_id, *tok.encode(context).tolist()], np.int32)[None]
        res = generate(params, cfg, ids, 6, eos_id=tok.eos_id, pad_id=tok.pad_id)
        want = tok.decode(np.asarray(res.tokens[0])[:int(res.lengths[0])], skip_special=True)
        assert text == want.split("\n")[0]
    with pytest.raises(ConfigError, match="num_beams"):
        lm.generate_until(requests("generate_until", [("x", {"num_beams": 2})]))


def test_diffusion_and_reward_runs_are_refused(base_run):
    run = open_run(base_run)
    diffusion = dataclasses.replace(run, tcfg=dataclasses.replace(run.tcfg, objective="diffusion"))
    with pytest.raises(ConfigError, match="diffusion run"):
        harness.MLXLM(diffusion)
    reward = dataclasses.replace(run, record=run.record.replace(
        kind="reward", settings=RewardConfig(task="arithmetic"), base=BaseRef(run=str(run.path), step=1)))
    with pytest.raises(ConfigError, match="not a language model"):
        harness.MLXLM(reward)


def test_the_model_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("mlx_llm") is harness.MLXLM
    assert get_model("dummy").__name__ == "DummyLM"  # the harness's own models stay registered


def test_packing_fills_rows_first_fit_and_changes_no_score(own):
    """Several requests in one row (each its own segment from position 0) score exactly as each alone."""
    assert harness.pack([10, 50, 7, 30, 20], 64) == [[1, 0], [3, 4, 2]]  # 50+10, 30+20+7
    params, cfg, tok, ll = own
    seqs = [([tok.bos_id, *tok.encode(text).tolist()], n) for text, n in
            (("x = 12 + 34", 3), ("def f(y): return y", 5), ("a", 1), ("import os\nimport sys", 8))]
    packed = harness.score(params, cfg, seqs, batch_size=2, pad_id=tok.pad_id)
    alone = [harness.score(params, cfg, [q], batch_size=1, pad_id=tok.pad_id)[0] for q in seqs]
    assert len(harness.pack([len(q) - 1 for q, _ in seqs], 32)) < len(seqs)  # they did share rows
    for (value, greedy), (want, want_greedy), (seq, n) in zip(packed, alone, seqs):
        assert value == pytest.approx(want, abs=1e-5) and greedy == want_greedy
        assert value == pytest.approx(ll(seq, n)[0], abs=1e-5)


def test_static_widths():
    assert [harness.bucket_width(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert harness.bucket_width(100, 100) == 100


# ----- through the harness ------------------------------------------------------------------------------------
def own_accuracy(ll, tok):
    """The multiple-choice accuracy recomputed here: argmax over choices of log p(" " + choice | question)."""
    right = [int(np.argmax([ll(sum(own_pair(tok, d["question"], " " + c), []), len(tok.encode(" " + c)))[0]
                            for c in d["choices"]])) == d["label"] for d in MC]
    return float(np.mean(right))


@pytest.mark.slow
def test_harness_results_equal_our_own_numbers(base_run, tasks_dir, own):
    params, cfg, tok, ll = own
    _, res = harness.evaluate_run(base_run, "mc_local,roll_local,gen_local", include=tasks_dir, log_samples=True)
    assert res["results"]["mc_local"]["acc,none"] == own_accuracy(ll, tok)
    assert 0 < own_accuracy(ll, tok) < 1  # the tasks' data make the comparison telling (1 of 8 for the shared run)
    for sample in res["samples"]["mc_local"]:
        d = sample["doc"]
        for choice, (value, _) in zip(d["choices"], sample["filtered_resps"]):
            ctx, cont = own_pair(tok, d["question"], " " + choice)
            assert value == pytest.approx(ll(ctx + cont, len(cont))[0], abs=1e-5)
    rolled = {s["doc"]["text"]: s["filtered_resps"][0] for s in res["samples"]["roll_local"]}
    for d in ROLL:
        assert rolled[d["text"]] == pytest.approx(own_rolling(ll, cfg, tok, d["text"]), abs=1e-5)
    n_bytes = sum(len(d["text"].encode()) for d in ROLL)
    bpb = -sum(own_rolling(ll, cfg, tok, d["text"]) for d in ROLL) / (n_bytes * np.log(2))
    assert res["results"]["roll_local"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    assert res["results"]["gen_local"]["exact_match,none"] == np.mean(
        [s["filtered_resps"][0] == s["target"] for s in res["samples"]["gen_local"]])
    assert res["config"]["checkpoint_step"] == open_run(base_run).latest_step()


@pytest.mark.slow
def test_simple_evaluate_finds_the_model_by_name(base_run, tasks_dir, own):
    _, _, tok, ll = own
    res = lm_eval.simple_evaluate(model="mlx_llm", model_args={"run": str(base_run), "batch_size": 3},
                                  tasks=["mc_local"], task_manager=TaskManager(include_path=str(tasks_dir),
                                                                               include_defaults=False))
    assert res["results"]["mc_local"]["acc,none"] == own_accuracy(ll, tok)


@pytest.mark.slow
def test_cli_prints_the_table_and_writes_the_json_into_the_run(base_run, tasks_dir, own, tmp_path):
    _, _, tok, ll = own
    run = shutil.copytree(base_run, tmp_path / "run")  # the shared run stays as it was
    proc = cli_in_process("eval", "--run", run, "--lm-eval", "mc_local", "--lm-eval-include", tasks_dir,
                          "--limit", 8, "--num-fewshot", 0)
    assert proc.returncode == 0, proc.stderr
    assert "mc_local" in proc.stdout and "acc" in proc.stdout and "|" in proc.stdout
    step = open_run(run).latest_step()
    written = json.loads((run / "lm_eval" / f"{step}-mc_local.json").read_text())  # RUN/lm_eval/<step>-<tasks>
    assert written["results"]["mc_local"]["acc,none"] == own_accuracy(ll, tok)
    assert "samples" not in written and written["config"]["run"] == str(run)
    assert f"{run / 'lm_eval' / f'{step}-mc_local.json'}" in proc.stdout


@pytest.mark.slow
def test_an_unknown_task_is_refused_in_one_line_and_nothing_is_written(base_run, tasks_dir, tmp_path):
    run = shutil.copytree(base_run, tmp_path / "run")
    before = snapshot(run)
    proc = cli_in_process("eval", "--run", run, "--lm-eval", "mc_local,no_such_task", "--lm-eval-include", tasks_dir)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no_such_task" in proc.stderr and "mc_local," not in proc.stderr
    assert "lm-eval ls tasks" in proc.stderr
    assert snapshot(run) == before


@pytest.mark.slow
def test_python_m_harness_runs_lm_evals_own_command_line(base_run, tasks_dir, capsys):
    harness.main(["--model", "mlx_llm", "--model_args", f"run={base_run}", "--tasks", "mc_local",
                  "--include_path", str(tasks_dir), "--limit", "2"])
    out = capsys.readouterr().out
    assert "mc_local" in out and "acc" in out


def test_lm_eval_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "mlx_llm.eval.harness", raising=False)
    with pytest.raises(ConfigError, match=r"lm_eval is not installed: pip install 'mlx_llm\[eval\]'"):
        importlib.import_module("mlx_llm.eval.harness")


def test_harness_flags_without_lm_eval_are_refused(base_run):
    proc = cli_in_process("eval", "--run", base_run, "--limit", 3, "--num-fewshot", 1)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "mlx-llm eval: error: --limit, --num-fewshot set(s) the lm-eval harness: give --lm-eval TASK[,TASK] too")
