"""ModelConfig: validation with named errors, JSON round trip, hashability, the generalised count."""

import dataclasses
import json

import jax
import pytest

from mlx_llm import ModelConfig
from mlx_llm.errors import ConfigError, MLXLLMError
from helpers import tiny_cfg

BASE = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=24, max_seq_len=64)


def test_defaults_and_hashable():
    cfg = ModelConfig(**BASE)
    assert (cfg.rope_base, cfg.rope_scale, cfg.norm_eps, cfg.tie_embeddings) == (10000.0, 1.0, 1e-6, False)
    assert hash(cfg) == hash(ModelConfig(**BASE)) and cfg == ModelConfig(**BASE)
    assert cfg.q_per_kv == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 8
    # usable as a static jit argument
    assert jax.jit(lambda c: c.d_model, static_argnums=0)(cfg) == 16


def test_json_round_trip(tmp_path):
    cfg = ModelConfig(**BASE, rope_scale=0.25, tie_embeddings=True)
    cfg.to_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path / "config.json") == cfg
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["rope_scale"] == 0.25 and data["tie_embeddings"] is True
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write leaves no temporary file


def test_integer_floats_normalised():
    assert ModelConfig(**BASE, rope_base=500000) == ModelConfig(**BASE, rope_base=500000.0)


def test_generalised_param_count():
    # n_heads * d_head (=16) != d_model (=12): P = 2Vd + L(2 d Hq Dh + 2 d Hkv Dh + 3 d m + 2d) + d
    cfg = ModelConfig(vocab_size=10, d_model=12, n_layers=3, n_heads=4, n_kv_heads=2, d_head=4, d_ff=20,
                      max_seq_len=8)
    assert cfg.param_count() == 2 * 10 * 12 + 3 * (2 * 12 * 16 + 2 * 12 * 8 + 3 * 12 * 20 + 24) + 12
    assert cfg.non_embedding_param_count() == cfg.param_count() - 240


@pytest.mark.parametrize(
    "change, message",
    [(dict(n_kv_heads=3), r"n_heads = 4 is not divisible by n_kv_heads = 3.*valid n_kv_heads: \[1, 2, 4\]"),
     (dict(d_head=5), r"d_head = 5 is odd: RoPE rotates coordinate pairs"),
     (dict(vocab_size=0), r"vocab_size = 0 is invalid: it must be a positive integer"),
     (dict(n_layers=-2), r"n_layers = -2 is invalid"),
     (dict(d_model=16.0), r"d_model = 16.0 is invalid: it must be a positive integer"),
     (dict(max_seq_len=True), r"max_seq_len = True is invalid"),
     (dict(norm_eps=0.0), r"norm_eps = 0.0 is invalid: it must be a finite number > 0"),
     (dict(norm_eps=-1e-6), r"norm_eps = -1e-06 is invalid"),
     (dict(rope_base=float("inf")), r"rope_base = inf is invalid: it must be a finite number > 0"),
     (dict(rope_scale=float("nan")), r"rope_scale = nan is invalid"),
     (dict(tie_embeddings="yes"), r"tie_embeddings = 'yes' is invalid: it must be true or false")],
)
def test_invalid_configs(change, message):
    with pytest.raises(ConfigError, match=message) as info:
        ModelConfig(**{**BASE, **change})
    assert isinstance(info.value, (MLXLLMError, ValueError))


def test_json_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"ModelConfig file .*missing.json. does not exist"):
        ModelConfig.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json' is not valid JSON"):
        ModelConfig.from_json(bad)
    bad.write_text(json.dumps({**BASE, "n_expert": 8}))
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) \['n_expert'\]"):
        ModelConfig.from_json(bad)
    bad.write_text(json.dumps({k: v for k, v in BASE.items() if k != "d_ff"}))
    with pytest.raises(ConfigError, match=r"ModelConfig.d_ff is not set: layers of kind 'swiglu' need it"):
        ModelConfig.from_json(bad)
    bad.write_text(json.dumps({k: v for k, v in BASE.items() if k != "d_model"}))
    with pytest.raises(ConfigError, match=r"missing required ModelConfig field\(s\) \['d_model'\]"):
        ModelConfig.from_json(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"expected a JSON object of ModelConfig fields, got list"):
        ModelConfig.from_json(bad)


def test_vocab_used_counts_the_token_rows_of_a_padded_vocabulary():
    assert tiny_cfg(vocab_size=64, vocab_used=60).vocab_used == 60
    for bad in (64, 65, 0, True, 3.0):
        with pytest.raises(ConfigError, match="vocab_used"):
            tiny_cfg(vocab_size=64, vocab_used=bad)
