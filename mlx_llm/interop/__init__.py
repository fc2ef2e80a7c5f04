"""Checkpoint interop with other libraries: Hugging Face transformers (``hf``: export a run as a Llama, Mamba or
Mixtral checkpoint directory; import one as a run)."""

from mlx_llm.interop.hf import HFModel, export_model, export_run, import_hf, load_hf

__all__ = ["export_run", "export_model", "import_hf", "load_hf", "HFModel"]
