"""Ready-made worked examples of M20 for tests and notebooks, as ``(cfg, params, tokens, targets)``.

Arrays are float64 NumPy so they keep the seed's digits; ``jnp.asarray`` them under ``jax_enable_x64``.
"""

from __future__ import annotations

import numpy as np

from mlx_llm.config import ModelConfig

# Vocabulary of the running example (M20 §3).
BOS, A, B, EOS = 0, 1, 2, 3


def running_example(tie_embeddings: bool = False):
    """M20 §3–§9: V=4, d=m=2, L=h_q=h_kv=1, the hand-set weights, inputs (0,1,2), targets (1,2,3).

    Tied (M20 §8, 42 parameters): U = Eᵀ, so ``unembed`` is absent and E serves both roles.
    """
    cfg = ModelConfig(vocab_size=4, d_model=2, n_layers=1, n_heads=1, n_kv_heads=1, d_head=2, d_ff=2,
                      max_seq_len=8, tie_embeddings=tie_embeddings)
    eye = np.eye(2)
    params = {
        "embed": np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]),
        "blocks": {
            "attn_norm": np.ones((1, 2)),
            "wq": (0.5 * eye).reshape(1, 2, 1, 2),
            "wk": (0.5 * eye).reshape(1, 2, 1, 2),
            "wv": np.diag([0.5, 1.0]).reshape(1, 2, 1, 2),
            "wo": (0.25 * eye).reshape(1, 1, 2, 2),
            "ffn_norm": np.ones((1, 2)),
            "w_gate": np.array([[[0.5, -0.25], [0.25, 0.5]]]),
            "w_up": np.array([[[1.0, 0.5], [-0.5, 1.0]]]),
            "w_down": (0.25 * eye)[None],
        },
        "final_norm": np.ones(2),
    }
    if not tie_embeddings:
        params["unembed"] = np.array([[0.0, 0.5, -0.5, 0.25], [0.0, -0.25, 0.5, -0.5]])
    tokens = np.array([[BOS, A, B]])
    targets = np.array([[A, B, EOS]])
    return cfg, params, tokens, targets


def second_configuration(n_kv_heads: int = 1, seed: int = 0):
    """M20 §8's second configuration: d=4, m=3, h_q=2, h_kv ∈ {1, 2}, V=4, L=1, untied (128 / 144 parameters).

    The seed gives no weights for it, so they are drawn (float64, N(0, 0.5²)) from ``seed``.
    """
    cfg = ModelConfig(vocab_size=4, d_model=4, n_layers=1, n_heads=2, n_kv_heads=n_kv_heads, d_head=2, d_ff=3,
                      max_seq_len=8)
    rng = np.random.default_rng(seed)
    shapes = {
        "embed": (4, 4),
        "blocks": {"attn_norm": (1, 4), "wq": (1, 4, 2, 2), "wk": (1, 4, n_kv_heads, 2),
                   "wv": (1, 4, n_kv_heads, 2), "wo": (1, 2, 2, 4), "ffn_norm": (1, 4),
                   "w_gate": (1, 4, 3), "w_up": (1, 4, 3), "w_down": (1, 3, 4)},
        "final_norm": (4,),
        "unembed": (4, 4),
    }

    def draw(tree):
        return {k: draw(v) if isinstance(v, dict) else (np.ones(v) if k.endswith("norm") else
                                                        0.5 * rng.standard_normal(v)) for k, v in tree.items()}

    tokens = np.array([[BOS, A, B, A]])
    targets = np.array([[A, B, A, EOS]])
    return cfg, draw(shapes), tokens, targets
