"""Tiny byte-level runs that the post-training tests share (session fixtures in conftest.py)."""

from pathlib import Path

import numpy as np

from mlx_llm import ModelConfig
from mlx_llm.config import TrainConfig
from mlx_llm.post.sft import sft_run
from mlx_llm.runs.configs import DataSpec, SFTConfig
from mlx_llm.runs.pretrain import train_run

BASE_CFG = ModelConfig(vocab_size=263, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                       max_seq_len=64)
SFT = dict(batch_size=16, seq_len=64, lr=3e-3, warmup_steps=10, weight_decay=0.0)


def pretrain(root: Path) -> Path:
    """A tiny byte-level model pretrained briefly on lines of arithmetic-looking code."""
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        (corpus / f"m{i}.py").write_text("".join(f"x = {rng.integers(100)} + {rng.integers(100)}\n"
                                                 for _ in range(300)))
    tcfg = TrainConfig(batch_size=8, seq_len=32, steps=20, lr=3e-3, warmup_steps=2, eval_interval=20,
                       eval_tokens=256, checkpoint_interval=20)
    spec = DataSpec(path=str(corpus), extensions=(".py",), val_percent=20.0, tokenizer="byte")
    train_run(root / "base", BASE_CFG, tcfg, spec, show_progress=False, cache_dir=root / "cache", sample_tokens=4,
              log=lambda *a: None)
    return root / "base"


def sft_arithmetic(root: Path, base: Path) -> Path:
    """The tiny base fully fine-tuned on ``arithmetic`` for 4,000 steps: past the steps where held-out exact match
    jumps (3.75 % after 1,500 steps, 23.9 % after 4,000), so the preference runs start from a model that answers a
    fifth of the problems. ``tests/build_sft_start.py`` writes it to tests/data/arithmetic_sft, which the suite
    uses (conftest.py)."""
    tcfg = TrainConfig(**SFT, steps=4000, eval_interval=4000, checkpoint_interval=4000)
    sft_run(root / "sft", base, tcfg=tcfg, settings=SFTConfig(task="arithmetic", n_train=20_000, eval_examples=None),
            show_progress=False, log=lambda *a: None)
    return root / "sft"
