"""Checkpoint interop with other libraries: Hugging Face transformers (``hf``: export a run as a checkpoint directory
of one of nine families — Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, Mamba, Gemma 2, Gemma 3; import one as
a run)."""

from mlx_llm.interop.hf import HFModel, export_model, export_run, import_hf, load_hf

__all__ = ["export_run", "export_model", "import_hf", "load_hf", "HFModel"]
