"""Validation loss, perplexity and bits per byte of a saved run's checkpoint on its whole val split."""

from __future__ import annotations

from mlx_llm.data.corpora import open_data
from mlx_llm.errors import ConfigError
from mlx_llm.runs.load import checkpoint_step, load_params
from mlx_llm.runs.record import open_run
from mlx_llm.runs.resume import data_change
from mlx_llm.train.lm import evaluate_sets
from mlx_llm.train.parallel import make_mesh
from mlx_llm.train.step import EvalResult, evaluate, make_eval_step


def evaluate_run(run_dir, *, cache_dir=None, step: int | None = None, kernels=None,
                 log=print) -> tuple[int, EvalResult]:
    """Val loss, perplexity and bits per byte of a run's latest (or given) checkpoint on its whole val split;
    ``kernels``: the execution paths (default "auto"), whatever the run was trained with. The data is read where
    the run recorded it (an absolute path), and when its files are no longer those the run recorded (their
    fingerprint), or the record keeps no fingerprint, ``log`` says so in one line before the scores are computed:
    the scores are then of the data as it is now."""
    run = open_run(run_dir)
    cfg, tcfg = run.cfg, run.tcfg
    if run.record.data is None:
        raise ConfigError(f"{run.path} records no corpus settings: there is no validation split to evaluate on")
    change = data_change(run)
    if change is not None:
        log(f"note: {change[1]}" + ("; the scores below are of the data as it is now" if change[0] else ""))
    data = open_data(run.path, run.record.data, tcfg.objective)
    corpus = data.build(cache_dir)
    mesh = make_mesh()
    ckpt_step = checkpoint_step(run, step)
    params = load_params(run, ckpt_step)
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, data.tokenizer.mask_id, kernels)
    return ckpt_step, evaluate_sets(corpus, tcfg, lambda vs: evaluate(eval_step, params, vs, mesh, tcfg.objective),
                                    None)
