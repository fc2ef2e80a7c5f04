"""Hugging Face interop: export a run as a transformers checkpoint directory, import one as a run.

``export_run(run_dir, out_dir)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``: ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` load it (Llama, Mamba or Mixtral, see ``hf_config``).
``import_hf(hf_dir, run_dir)`` writes a run directory (config.json, train_config.json, run.json, tokenizer.json,
one checkpoint) that ``mlx-llm generate / eval / sft --base`` use like any other. import(export(x)) gives back
x's parameters and ModelConfig bit for bit.

Neither direction needs torch: tensors go through ``safetensors.numpy``. Nothing is written when anything is
refused, and a directory is only ever created whole (written beside its target under a temporary name, then
renamed), so a failed export or import leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.interop import hf_config, hf_tokenizer, hf_weights
from mlx_llm.train import tokenizer as tok_lib

WEIGHTS_FILE, INDEX_FILE, CONFIG_FILE = "model.safetensors", "model.safetensors.index.json", "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
IMPORT_STEP = 0  # the checkpoint step of an imported run


# ----- output directories ---------------------------------------------------------------------------------
def check_new_dir(path: Path, what: str) -> None:
    """``path`` must not exist, or be an empty directory: nothing is ever overwritten."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{what} {str(path)!r} exists and is not empty; choose a new directory")


@contextlib.contextmanager
def new_dir(path: Path):
    """Yield a temporary sibling of ``path`` to fill; on success it becomes ``path``, on failure it is removed."""
    path = Path(path).absolute()
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # empty (checked before): rename needs it gone
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----- export -----------------------------------------------------------------------------------------------
def check_offsets(params: dict, cfg: ModelConfig) -> None:
    """Mixtral routes by the router logits alone: every balancing offset must be exactly zero."""
    offsets = np.asarray(params["blocks"]["router_offset"])
    bad = np.argwhere(offsets != 0)
    if bad.size:
        where = ", ".join(f"layer {l} expert {e}: {offsets[l, e]:.4g}" for l, e in bad[:6])
        raise ConfigError(f"cannot export as MixtralForCausalLM: {len(bad)} balancing offset(s) are nonzero "
                          f"({where}{', …' if len(bad) > 6 else ''}); Mixtral has no routing offsets, so it would "
                          f"choose other experts than this model (train with offset_rate = 0 to export)")


def export_model(params: dict, cfg: ModelConfig, tok: tok_lib.Tokenizer, out_dir, *,
                 provenance: dict | None = None) -> Path:
    """Write the transformers checkpoint directory of ``params`` (our layout, DESIGN §1) with ``tok``.
    Everything is checked before anything is written; ``provenance`` goes into config.json's "mlx_llm" block."""
    from safetensors.numpy import save_file

    arch = hf_config.architecture(cfg)
    if arch == hf_config.MIXTRAL:
        check_offsets(params, cfg)
    if tok.vocab_size != cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}")
    out_dir = Path(out_dir)
    check_new_dir(out_dir, "export directory")
    tensors = hf_weights.to_hf(params, cfg, arch)
    ids = hf_tokenizer.special_ids(tok)
    config = hf_config.to_hf(cfg, arch, ids, {"provenance": provenance or {}}, str(tensors_dtype(tensors)))
    with new_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / GENERATION_CONFIG_FILE, {f"{k}_token_id": v for k, v in ids.items()})
        _write_json(tmp / hf_tokenizer.TOKENIZER_FILE, hf_tokenizer.tokenizer_json(tok))
        _write_json(tmp / hf_tokenizer.TOKENIZER_CONFIG_FILE, hf_tokenizer.tokenizer_config(tok, cfg.max_seq_len))
    return out_dir


def tensors_dtype(tensors: dict) -> np.dtype:
    """The one floating dtype of the checkpoint (config.json's "dtype")."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ConfigError(f"the parameters mix dtypes {sorted(map(str, dtypes))}: export one dtype (cast them first)")
    return dtypes.pop()


def export_run(run_dir, out_dir, *, step: int | None = None) -> Path:
    """Export a run's checkpoint (latest, or ``step``): a pretrained or fine-tuned language model; a LoRA run
    is exported with its adapters folded into the base (``train.run.load_params``). Reward models and
    masked-diffusion runs are refused."""
    from mlx_llm.train.checkpoint import read_run_files
    from mlx_llm.train.run import load_params

    run_dir = Path(run_dir)
    cfg, tcfg, info = read_run_files(run_dir)
    if (info.get("post") or {}).get("kind") == "reward":
        raise ConfigError(f"cannot export {run_dir}: it is a reward model (a trunk and a scalar reward head), not a "
                          f"language model; transformers' causal-LM classes have no reward head")
    if tcfg.objective != "ar" or not cfg.causal:
        raise ConfigError(f"cannot export {run_dir}: it is a masked-diffusion denoiser (objective "
                          f"{tcfg.objective!r}, causal = {cfg.causal}); transformers' causal-LM classes predict "
                          f"the next token from earlier ones only")
    hf_config.architecture(cfg)  # refuse before restoring anything
    check_new_dir(Path(out_dir), "export directory")
    tok = tok_lib.load(run_dir)
    if step is None:
        step = latest_step(run_dir)
    params = load_params(run_dir, cfg, tcfg, step)
    provenance = {"run": str(run_dir.resolve()), "step": step, "data": info.get("data"),
                  "train_config": tcfg.to_dict()}
    return export_model(jax_to_numpy(params), cfg, tok, out_dir, provenance=provenance)


def latest_step(run_dir: Path) -> int:
    """The run's latest checkpoint step (looked up without creating anything in the run)."""
    from mlx_llm.train.checkpoint import CHECKPOINT_DIR, Checkpoints

    if not (run_dir / CHECKPOINT_DIR).is_dir():
        raise CheckpointError(f"{run_dir} has no {CHECKPOINT_DIR}/ directory: there is no checkpoint to export")
    ckpts = Checkpoints(run_dir)
    try:
        step = ckpts.latest_step()
    finally:
        ckpts.close()
    if step is None:
        raise CheckpointError(f"{run_dir / CHECKPOINT_DIR} holds no checkpoint to export")
    return step


def jax_to_numpy(tree):
    import jax

    return jax.tree.map(np.asarray, tree)


# ----- import -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HFModel:
    """What ``load_hf`` reads: our config, parameters (float32 numpy), tokenizer, the transformers class and
    config.json's "mlx_llm" block (empty for a checkpoint that did not come from ``export_model``)."""

    cfg: ModelConfig
    params: dict
    tok: tok_lib.Tokenizer
    hf_class: str
    block: dict


def _read_config(hf_dir: Path) -> dict:
    path = hf_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{str(hf_dir)!r} is not a transformers checkpoint directory: it has no {CONFIG_FILE}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return obj


def weight_files(hf_dir: Path) -> list[Path]:
    """``model.safetensors``, or the shards named by ``model.safetensors.index.json``."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return [hf_dir / WEIGHTS_FILE]
    if (hf_dir / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((hf_dir / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{hf_dir / INDEX_FILE} is not a safetensors index ({exc})") from None
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{hf_dir / INDEX_FILE} names shard(s) {missing} that are not in {hf_dir}")
        return files
    pickles = [name for name in PICKLE_FILES if (hf_dir / name).exists()]
    if pickles:
        raise CheckpointError(f"{hf_dir} holds only {pickles[0]} (a pickled torch checkpoint): import reads "
                              f"safetensors only, because unpickling runs arbitrary code; convert it with "
                              f"transformers' save_pretrained(..., safe_serialization=True) first")
    raise CheckpointError(f"{hf_dir} has no {WEIGHTS_FILE} (nor {INDEX_FILE}): no weights to import")


def read_tensors(files: list[Path]) -> dict:
    from safetensors.numpy import load_file

    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise CheckpointError(f"{f} is not a readable safetensors file: {exc}") from None
    return tensors


def load_hf(hf_dir) -> HFModel:
    """Read a transformers checkpoint directory (Llama, Mamba or Mixtral, safetensors) into our layout."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{str(hf_dir)!r} is not a directory (give a transformers checkpoint directory)")
    hf = _read_config(hf_dir)
    source = str(hf_dir / CONFIG_FILE)
    arch = hf_config.arch_of(hf, source)
    cfg = hf_config.from_hf(hf, arch, source)
    files = weight_files(hf_dir)
    tok = hf_tokenizer.from_hf(hf_dir)
    if tok.vocab_size != cfg.vocab_size:
        raise ConfigError(f"{hf_dir}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                          f"{cfg.vocab_size}; an mlx_llm run needs them equal (every id a token, every token an id)")
    params = hf_weights.from_hf(read_tensors(files), cfg, arch, str(hf_dir))
    return HFModel(cfg, params, tok, hf_config.CLASSES[arch], hf_config.mlx_block(hf))


def provenance(block: dict) -> dict:
    """Where an exported checkpoint came from (``export_run``): run, step, data settings, train config."""
    record = block.get("provenance")
    return record if isinstance(record, dict) else {}


def _train_config(block: dict, cfg: ModelConfig) -> TrainConfig:
    """The exported run's TrainConfig when config.json carries one that still parses, else defaults whose
    sequence length fits the model."""
    stored = provenance(block).get("train_config")
    if stored:
        with contextlib.suppress(ConfigError, TypeError):
            tcfg = TrainConfig.from_dict(stored)
            if tcfg.seq_len <= cfg.max_seq_len:
                return tcfg
    seq_len = min(TrainConfig.seq_len, cfg.max_seq_len)
    return TrainConfig(seq_len=seq_len)


def _data_spec(block: dict, tok: tok_lib.Tokenizer) -> dict:
    from mlx_llm.train.run import DataSpec

    stored = provenance(block).get("data")
    if stored:
        with contextlib.suppress(TypeError, KeyError):
            return DataSpec.from_dict(stored).to_dict()
    kind = "byte" if isinstance(tok, tok_lib.ByteTokenizer) else "bpe"
    return DataSpec(tokenizer=kind, vocab_size=tok.vocab_size).to_dict()


def import_hf(hf_dir, out_run_dir) -> Path:
    """Write ``out_run_dir``: a run holding the transformers checkpoint ``hf_dir`` as its step-0 checkpoint.
    run.json records where it came from under "imported"; its data settings are the exported run's when the
    checkpoint came from ``export_run``, else the default corpus with the imported tokenizer."""
    from mlx_llm.train.checkpoint import Checkpoints, write_run_files
    from mlx_llm.train.step import init_state, optimizer_for

    out = Path(out_run_dir)
    check_new_dir(out, "run directory")
    model = load_hf(hf_dir)
    tcfg = _train_config(model.block, model.cfg)
    info = {"data": _data_spec(model.block, model.tok),
            "imported": {"from": str(Path(hf_dir).resolve()), "class": model.hf_class,
                         "exported_from": provenance(model.block).get("run")}}
    with new_dir(out) as tmp:
        write_run_files(tmp, model.cfg, tcfg, info)
        model.tok.save(tmp)
        state = init_state(model.cfg, tcfg, optimizer_for(tcfg), model.params).replace(
            step=np.int32(IMPORT_STEP), data_step=np.int32(IMPORT_STEP))
        ckpts = Checkpoints(tmp)
        ckpts.save(IMPORT_STEP, state)
        ckpts.close()
    return out
