"""Text from a run: the closing sample of a training run and ``mlx-llm generate`` (M20 §13)."""

from __future__ import annotations

import numpy as np

from mlx_llm.config import SEED_MAX, ModelConfig
from mlx_llm.decode.diffusion import sample
from mlx_llm.decode.engine import Request, complete
from mlx_llm.decode.generate import check_generation, generate
from mlx_llm.errors import ConfigError
from mlx_llm.settings import check_int
from mlx_llm.runs.load import as_run, checkpoint_step, load_params
from mlx_llm.data import tokenizer as tok_lib

DIFFUSION_SAMPLE_STEPS = 64  # denoising steps of a diffusion run's closing sample


def closing_sample(params, cfg: ModelConfig, tok, prompt: str, max_new_tokens: int, *, seed: int = 0,
                   temperature: float = 0.8, top_p: float = 0.95, objective: str = "ar") -> str:
    """The prompt and a sampled continuation from the cached decoder (stops at EOS or the length limit); for a
    diffusion run, ``max_new_tokens`` positions from the ancestral sampler (64 steps, cut at the first EOS)."""
    ids = np.concatenate([tok.bos_prefix, tok.encode(prompt)]).astype(np.int32)[None]
    n_new = max(1, min(max_new_tokens, cfg.max_seq_len - ids.shape[1]))
    if objective == "diffusion":
        out = np.asarray(sample(params, cfg, ids, n_new, steps=DIFFUSION_SAMPLE_STEPS, mask_id=tok.mask_id,
                                temperature=temperature, seed=seed))[0, ids.shape[1]:]
        return prompt + tok.decode(_until_eos(out, tok.eos_id), skip_special=True)
    # the static decoder: one program per run where the engine compiles three (a prefill, a decode step, a decode
    # scan), and every training run ends here (the test suite's runs paid minutes for it)
    out = generate(params, cfg, ids, n_new, temperature=temperature, top_p=top_p, eos_id=tok.eos_id,
                   pad_id=tok.pad_id, seed=seed)
    new = np.asarray(out.tokens[0])[: int(out.lengths[0])]
    return prompt + tok.decode(new, skip_special=True)


def _stop_ids(tok) -> tuple:
    return () if tok.eos_id is None else (int(tok.eos_id),)


def _until_eos(ids, eos_id: int):
    hits = np.flatnonzero(ids == eos_id)
    return ids[: hits[0]] if hits.size else ids


def check_sampling(cfg: ModelConfig, seed, beam_width) -> None:
    check_int("seed", seed, 0, maximum=SEED_MAX)
    if beam_width is not None and not 1 <= beam_width <= cfg.vocab_size:
        raise ConfigError(f"beam width = {beam_width!r} is invalid: it must be between 1 and the vocabulary size "
                          f"{cfg.vocab_size}")


def generate_from_run(run_dir, prompt: str, *, max_new_tokens: int, temperature=None, top_k=None, top_p=None,
                      beam_width=None, seed: int = 0, step: int | None = None, diffusion_steps: int | None = None,
                      sampler: str | None = None, kernels=None) -> dict:
    """Continue ``prompt`` with a run's checkpoint; the record holds everything needed to reproduce it (M20 §13).
    A diffusion run is sampled with ``decode.diffusion.sample`` (``sampler``, ``diffusion_steps`` steps,
    ``max_new_tokens`` generated positions, cut at the first EOS); the AR settings top-k/top-p/beam do not apply.
    ``kernels``: the execution paths (default the reference ones). ``diffusion_steps`` (default 64) and
    ``sampler`` (default ancestral) are refused on an autoregressive run, as top-k/top-p/beam are on a diffusion
    run: a setting that cannot apply is an error, not ignored."""
    run = as_run(run_dir)
    run.require_language_model("generate")
    cfg, tcfg, run_dir = run.cfg, run.tcfg, run.path
    tok = tok_lib.load(run_dir)
    ckpt_step = checkpoint_step(run, step)
    check_sampling(cfg, seed, beam_width)
    ids = np.concatenate([tok.bos_prefix, tok.encode(prompt)]).astype(np.int32)
    if ids.size == 0:
        raise ConfigError("--prompt is empty and this run's tokenizer has no BOS token to start from: give the "
                          "prompt some text (or ids)")
    if tcfg.objective == "diffusion":
        if top_k is not None or top_p is not None or beam_width is not None:
            raise ConfigError("--top-k, --top-p and --beam are autoregressive settings: a diffusion run takes "
                              "--temperature, --diffusion-steps and --sampler")
        params = load_params(run, ckpt_step)
        diffusion_steps = DIFFUSION_SAMPLE_STEPS if diffusion_steps is None else diffusion_steps
        sampler = "ancestral" if sampler is None else sampler
        out = np.asarray(sample(params, cfg, ids[None], max_new_tokens, steps=diffusion_steps, mask_id=tok.mask_id,
                                sampler=sampler, temperature=temperature, seed=seed, kernels=kernels))[0, ids.size:]
        new = _until_eos(out, tok.eos_id)
        return {"run": str(run_dir), "checkpoint_step": ckpt_step, "prompt": prompt, "prompt_ids": ids.tolist(),
                "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampler": sampler,
                             "diffusion_steps": diffusion_steps, "eos_id": tok.eos_id},
                "seed": seed, "continuation_ids": new.tolist(), "continuation": tok.decode(new, skip_special=True)}
    if diffusion_steps is not None or sampler is not None:
        raise ConfigError("--diffusion-steps and --sampler are settings of a diffusion run; this run is "
                          "autoregressive (objective 'ar'): sample it with --temperature / --top-k / --top-p / --beam")
    params = load_params(run, ckpt_step)
    if beam_width is not None:  # beam search keeps its own loop (a search over beams, not one token per row)
        out = generate(params, cfg, ids[None], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       beam_width=beam_width, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed, kernels=kernels)
        new = np.asarray(out.tokens[0])[: int(out.lengths[0])]
        logq, logp = float(np.asarray(out.logq)[0]), float(np.asarray(out.logp)[0])
    else:
        check_generation(cfg, ids[None], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed)
        reply = complete(params, cfg, [Request(tuple(int(t) for t in ids), max_tokens=max_new_tokens,
                                               temperature=temperature or 0.0, top_k=top_k or 0,
                                               top_p=1.0 if top_p is None else top_p, stop_ids=_stop_ids(tok),
                                               seed=seed, logprobs=True)], kernels=kernels)[0].replies[0]
        new = np.asarray(reply.tokens, np.int32)
        logq, logp = float(np.sum(reply.logq)), float(np.sum(reply.logp))
    return {"run": str(run_dir), "checkpoint_step": ckpt_step, "prompt": prompt, "prompt_ids": ids.tolist(),
            "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                         "top_p": top_p, "beam_width": beam_width, "eos_id": tok.eos_id},
            "seed": seed, "continuation_ids": new.tolist(), "continuation": tok.decode(new, skip_special=True),
            "logq": logq, "logp": logp}
