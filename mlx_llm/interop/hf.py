"""Hugging Face interop: export a run as a transformers checkpoint directory, import one as a run.

``export_run(run_dir, out_dir)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``: ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` load it (the nine families of ``hf_config.CLASSES``).
``import_hf(hf_dir, run_dir)`` writes a run directory (config.json, train_config.json, run.json, tokenizer.json,
one checkpoint) that ``mlx-llm generate / eval / sft --base`` use like any other. import(export(x)) gives back
x's parameters and ModelConfig bit for bit. An export records no local absolute path (``data_provenance``); an
import reads a snapshot of the Hugging Face hub cache, whose files are links into its repository's blobs/
(``hf_tokenizer.hf_file``).

Neither direction needs torch: tensors go through ``safetensors.numpy``. Nothing is written when anything is
refused, and a directory is only ever created whole (written beside its target under a temporary name, then
renamed), so a failed export or import leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from mlx_llm.config import ModelConfig, TrainConfig, umask_mode
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.interop import hf_config, hf_weights
from mlx_llm.data import hf_tokenizer
from mlx_llm.runs.configs import TOKENIZERS, DataSpec
from mlx_llm.runs.rundir import check_new_dir, new_dir
from mlx_llm.runs.load import checkpoint_step, load_params, write_checkpoint_run
from mlx_llm.runs.record import RunRecord, open_run
from mlx_llm.scaling import mup
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.settings import JsonProblem, read_json

WEIGHTS_FILE, INDEX_FILE, CONFIG_FILE = "model.safetensors", "model.safetensors.index.json", "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
IMPORT_STEP = 0  # the checkpoint step of an imported run


# ----- output directories ---------------------------------------------------------------------------------
def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----- export -----------------------------------------------------------------------------------------------
def check_offsets(params: dict, cfg: ModelConfig, name: str = "MixtralForCausalLM") -> None:
    """Mixtral and Qwen3-MoE route by the router logits alone: every balancing offset must be exactly zero."""
    groups = [params["blocks"]] if cfg.uniform else params["blocks"]
    stacked = np.stack([np.asarray(g["router_offset"]) for g in groups], axis=1)  # (L/P, P, X): row r, group g
    offsets = stacked.reshape(-1, stacked.shape[-1])  # layer ℓ = r·P + g, in stack order
    bad = np.argwhere(offsets != 0)
    if bad.size:
        where = ", ".join(f"layer {l} expert {e}: {offsets[l, e]:.4g}" for l, e in bad[:6])
        raise ConfigError(f"cannot export as {name}: {len(bad)} balancing offset(s) are nonzero "
                          f"({where}{', …' if len(bad) > 6 else ''}); {name} has no routing offsets, so it would "
                          f"choose other experts than this model (train with offset_rate = 0 to export)")


def without_mtp(params: dict, cfg: ModelConfig, log=None) -> tuple[dict, ModelConfig]:
    """The model without its multi-token-prediction modules (``mtp_depth`` D, DeepSeek-V3): transformers' causal-LM
    classes have none, and generation never uses them, so export drops them and says so through ``log``."""
    if not cfg.mtp_depth:
        return params, cfg
    if log is not None:
        log(f"export: dropped the {cfg.mtp_depth} multi-token-prediction module(s) (mtp_depth = {cfg.mtp_depth}): "
            f"transformers has no such modules; the exported model generates exactly as this one does")
    return {k: v for k, v in params.items() if k != "mtp"}, dataclasses.replace(cfg, mtp_depth=0)


def export_model(params: dict, cfg: ModelConfig, tok: tok_lib.Tokenizer, out_dir, *,
                 provenance: dict | None = None, log=None) -> Path:
    """Write the transformers checkpoint directory of ``params`` (our layout, DESIGN §1) with ``tok``.
    Everything is checked before anything is written; ``provenance`` goes into config.json's "mlx_llm" block.
    MTP modules are dropped, with a line to ``log`` (``without_mtp``). A μP model is written as the standard
    model that computes the same logits (``scaling.mup.to_standard``: the output multiplier in ``lm_head``, the
    attention scale in W^Q; untied), so importing it back gives that standard model, not the μP parameters."""
    from safetensors.numpy import save_file

    params, cfg = without_mtp(params, cfg, log)
    params, cfg = mup.to_standard(params, cfg)  # μP: the multipliers folded into the weights (a standard model)
    arch = hf_config.architecture(cfg)
    if arch in hf_config.MOE_ARCHS:
        check_offsets(params, cfg, hf_config.CLASSES[arch])
    if tok.vocab_size != (cfg.vocab_used or cfg.vocab_size):
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model has "
                          f"{cfg.vocab_used or cfg.vocab_size} token rows (vocab_used / vocab_size): they must be "
                          f"equal")
    out_dir = Path(out_dir)
    check_new_dir(out_dir, "export directory")
    tensors = hf_weights.to_hf(params, cfg, arch)
    ids = hf_tokenizer.special_ids(tok)
    config = hf_config.to_hf(cfg, arch, ids, {"provenance": provenance or {}}, str(tensors_dtype(tensors)))
    with new_dir(out_dir, sum(t.nbytes for t in tensors.values()) + (1 << 20)) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_FILE, umask_mode())  # safetensors creates it private (0o600)
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


def export_run(run_dir, out_dir, *, step: int | None = None, log=None) -> Path:
    """Export a run's checkpoint (latest, or ``step``): a pretrained or fine-tuned language model; a LoRA run
    is exported with its adapters folded into the base (``runs.load.load_params``). Reward models and
    masked-diffusion runs are refused; MTP modules are dropped with a line to ``log``."""
    run = open_run(run_dir)
    cfg, tcfg = run.cfg, run.tcfg
    if run.kind == "reward":
        raise ConfigError(f"cannot export {run.path}: it is a reward model (a trunk and a scalar reward head), not a "
                          f"language model; transformers' causal-LM classes have no reward head")
    if tcfg.objective != "ar" or not cfg.causal:
        raise ConfigError(f"cannot export {run.path}: it is a masked-diffusion denoiser (objective "
                          f"{tcfg.objective!r}, causal = {cfg.causal}); transformers' causal-LM classes predict "
                          f"the next token from earlier ones only")
    hf_config.architecture(mup.standard_config(dataclasses.replace(cfg, mtp_depth=0)))  # refuse before restoring
    check_new_dir(Path(out_dir), "export directory")
    tok = hf_tokenizer.run_tokenizer(run.path, run.record.template)  # with the run's chat template
    if tok.external:
        raise ConfigError(f"cannot export {run.path}: it was trained on token ids whose tokenizer it does not hold "
                          f"(an IdTokenizer); a transformers checkpoint needs its tokenizer: train with --tokenizer "
                          f"PATH (the tokenizer the ids were made with) to export")
    step = checkpoint_step(run, step)
    params = load_params(run, step)
    provenance = {"run": run.path.resolve().name, "step": step, "data": data_provenance(run.record.data),
                  "train_config": tcfg.to_dict()}
    return export_model(jax_to_numpy(params), cfg, tok, out_dir, provenance=provenance, log=log)


LOCATION_FIELDS = ("path", "mixture")  # DataSpec's fields that say where the data lies


def data_provenance(spec: DataSpec | None) -> dict | None:
    """What an export records of its run's data in config.json, which is published with the checkpoint: the data
    settings, with where the data lay by name only — the corpus's last path component (``name``), each mixture
    source as ``NAME=name:WEIGHT`` (``sources``), a tokenizer file's name — never a local absolute path."""
    if spec is None:
        return None
    out = {k: v for k, v in spec.to_dict().items() if k not in LOCATION_FIELDS}
    if spec.tokenizer not in TOKENIZERS:
        out["tokenizer"] = Path(spec.tokenizer).name
    if spec.path is not None:
        out["name"] = Path(spec.path).name
    if spec.mixture:
        out["sources"] = [f"{s.name}={Path(s.path).name}:{s.weight!r}" for s in spec.sources]
    return out


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
    path = inside_name(hf_dir, CONFIG_FILE, str(hf_dir))
    if not path.is_file():
        raise CheckpointError(f"{str(hf_dir)!r} is not a transformers checkpoint directory: it has no {CONFIG_FILE}")
    try:
        obj = read_json(path)
    except JsonProblem as exc:
        raise CheckpointError(f"{path} cannot be read as JSON: {exc.detail}"
                              + (f" (line {exc.line})" if exc.line else "")) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return obj


def inside_name(hf_dir: Path, name, what: str) -> Path:
    """``hf_dir / name`` for a file name of the checkpoint directory (untrusted): it must resolve, links followed,
    inside ``hf_dir``, or into its repository's blobs/ for a snapshot of the Hugging Face hub cache
    (``hf_tokenizer.hf_file``); anything else is refused naming it (and a link's target)."""
    return hf_tokenizer.hf_file(hf_dir, name, what, CheckpointError)


def inside(hf_dir: Path, name, what: str) -> Path:
    """``inside_name``, which must be a regular file."""
    path = inside_name(hf_dir, name, what)
    if not path.is_file():
        raise CheckpointError(f"{what} names {name!r}, which is not a file in {hf_dir}")
    return path


def weight_files(hf_dir: Path) -> list[Path]:
    """``model.safetensors``, or the shards named by ``model.safetensors.index.json`` (each inside ``hf_dir``)."""
    if (hf_dir / WEIGHTS_FILE).exists():
        return [inside(hf_dir, WEIGHTS_FILE, str(hf_dir))]
    if (hf_dir / INDEX_FILE).is_file():
        try:
            index = read_json(inside(hf_dir, INDEX_FILE, str(hf_dir)))
        except JsonProblem as exc:
            raise CheckpointError(f"{hf_dir / INDEX_FILE} is not a safetensors index ({exc.detail})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{hf_dir / INDEX_FILE} is not a safetensors index: its weight_map must be an "
                                  f"object mapping tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        return [inside(hf_dir, name, str(hf_dir / INDEX_FILE)) for name in names]
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
    """Read a transformers checkpoint directory (one of ``hf_config.CLASSES``, safetensors) into our layout."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{str(hf_dir)!r} is not a directory (give a transformers checkpoint directory)")
    hf = _read_config(hf_dir)
    source = str(hf_dir / CONFIG_FILE)
    arch = hf_config.arch_of(hf, source)
    cfg = hf_config.from_hf(hf, arch, source)
    files = weight_files(hf_dir)
    tok = hf_tokenizer.from_hf(hf_dir, hf)  # roles from tokenizer_config.json and config.json
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{hf_dir}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is only "
                          f"{cfg.vocab_size}: an id would have no embedding row")
    if tok.vocab_size < cfg.vocab_size:  # a padded vocabulary (Qwen's): the rows past the tokenizer pad
        cfg = dataclasses.replace(cfg, vocab_used=tok.vocab_size)
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


def _data_spec(block: dict, tok: tok_lib.Tokenizer) -> DataSpec:
    """The imported run's data settings: the exported run's (``data_provenance``) when config.json carries them,
    but never a location: a checkpoint comes from elsewhere, and nothing in it may point the run at a local file,
    so the corpus is the default one and the tokenizer setting is byte or bpe."""
    kind = "byte" if isinstance(tok, tok_lib.ByteTokenizer) else "bpe"
    stored = provenance(block).get("data")
    if isinstance(stored, dict):
        # the exported run's data fingerprint is of its own corpus, not of the default one the import names
        keep = {f.name for f in dataclasses.fields(DataSpec)} - set(LOCATION_FIELDS) - {"fingerprint"}
        settings = {k: v for k, v in stored.items() if k in keep}
        if settings.get("tokenizer") not in TOKENIZERS:
            settings["tokenizer"] = kind
        with contextlib.suppress(ConfigError, TypeError, ValueError):
            return DataSpec(**settings)
    return DataSpec(tokenizer=kind, vocab_size=tok.vocab_size)


def import_hf(hf_dir, out_run_dir) -> Path:
    """Write ``out_run_dir``: a run (kind "imported") holding the transformers checkpoint ``hf_dir`` as its step-0
    checkpoint; its provenance says where it came from. Its data settings are the exported run's when the
    checkpoint came from ``export_run``, else the default corpus with the imported tokenizer."""
    out = Path(out_run_dir)
    check_new_dir(out, "run directory")
    model = load_hf(hf_dir)
    record = RunRecord(kind="imported", data=_data_spec(model.block, model.tok),
                       provenance={"imported": {"from": str(Path(hf_dir).resolve()), "class": model.hf_class,
                                                "exported_from": provenance(model.block).get("run")}})
    return write_checkpoint_run(out, model.cfg, _train_config(model.block, model.cfg), record, model.tok,
                                model.params, IMPORT_STEP)
