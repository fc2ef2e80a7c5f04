"""The model's RMSNorm (M20 §4) with the config's gain parametrisation: γ, or 1 + w under ``norm_unit_offset``."""

from __future__ import annotations

from mlx_llm.ops import rms_norm


def norm(h, gain, cfg):
    """N_γ(h) = γ ⊙ h/ρ(h) with ``cfg.norm_eps``; under ``cfg.norm_unit_offset`` the stored gain is w and γ = 1 + w
    (Gemma's zero-centred gains)."""
    return rms_norm(h, gain, cfg.norm_eps, 1.0 if getattr(cfg, "norm_unit_offset", False) else 0.0)


def post_norm(out, layer, key: str, cfg):
    """A sublayer's output through its sandwich norm ``layer[key]`` (Gemma 2/3) when ``cfg.sandwich_norm``, else
    as it is."""
    return norm(out, layer[key], cfg) if getattr(cfg, "sandwich_norm", False) else out
