"""The shared test helpers (tests/helpers.py): the tiny_cfg factory."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.errors import ConfigError
from helpers import TINY, TINY_CFG, tiny_cfg


@pytest.mark.slow
def test_tiny_cfg_is_a_valid_small_config():
    cfg = tiny_cfg()
    assert isinstance(cfg, ModelConfig)
    assert {f: getattr(cfg, f) for f in TINY_CFG} == TINY_CFG
    assert cfg == ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32,
                              max_seq_len=32)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # round-trips like a saved config
    assert tiny_cfg() == cfg and hash(tiny_cfg()) == hash(cfg)  # a fresh, equal config each call
    params = init_params(cfg, jax.random.key(0))
    logits = forward(params, jnp.zeros((1, 8), jnp.int32), cfg)
    assert logits.shape == (1, 8, 64)


def test_tiny_cfg_applies_overrides():
    cfg = tiny_cfg(vocab_size=263, n_layers=4, max_seq_len=64, mixer_pattern=("mamba", "attn"), ssm_state=4)
    assert (cfg.vocab_size, cfg.n_layers, cfg.max_seq_len, cfg.mixer_pattern, cfg.ssm_state) == \
        (263, 4, 64, ("mamba", "attn"), 4)
    assert (cfg.d_model, cfg.n_heads, cfg.d_ff) == (16, 4, 32)  # the rest stay the defaults
    assert cfg == dataclasses.replace(tiny_cfg(), vocab_size=263, n_layers=4, max_seq_len=64,
                                      mixer_pattern=("mamba", "attn"), ssm_state=4)
    assert TINY == tiny_cfg(vocab_size=263, n_heads=2, n_kv_heads=1, d_head=8, max_seq_len=64)
    assert TINY_CFG["vocab_size"] == 64  # overrides do not leak into the defaults
    with pytest.raises(ConfigError, match=r"n_heads = 4 is not divisible by n_kv_heads = 3"):
        tiny_cfg(n_kv_heads=3)
    with pytest.raises(TypeError):
        tiny_cfg(not_a_field=1)
