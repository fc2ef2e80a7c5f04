"""Counting: parameters (M20 §8, U19 §3), experts (U19 §3), LoRA (U19 §10), FLOPs (U19 §8), KV cache
(U19 §6, M20 §14). Every worked number of those sections is asserted here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, examples, init_params
from mlx_llm.scaling.accounting import (KVShape, approx_params, bytes_per_scalar, gpt2_block_params, gpt2_params,
                                        kv_cache_bytes, kv_cache_scalars, kv_rows, lora_minillm_params,
                                        lora_model_params, lora_params, matmul_params, minillm_params, moe_ffn_params,
                                        moe_params, train_flops_per_token, training_flops, tree_size)
from mlx_llm.errors import ConfigError, InputError

MIB, GIB = 2**20, 2**30


# ----- parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tied, expected", [(False, 50), (True, 42)])
def test_running_example_count_m20_s8(tied, expected):
    cfg, params, _, _ = examples.running_example(tie_embeddings=tied)
    assert minillm_params(cfg) == expected == tree_size(params)


@pytest.mark.parametrize("n_kv, expected", [(1, 128), (2, 144)])
def test_second_configuration_count_m20_s8(n_kv, expected):
    cfg, params, _, _ = examples.second_configuration(n_kv_heads=n_kv)
    assert minillm_params(cfg) == expected == tree_size(params)


@pytest.mark.parametrize("tied", [False, True])
def test_count_equals_scalars_of_init_params(tied):
    # h_q·d_h ≠ d, GQA, m ≠ 4d, L > 1: every term of the formula is exercised.
    cfg = ModelConfig(vocab_size=11, d_model=6, n_layers=3, n_heads=4, n_kv_heads=2, d_head=4, d_ff=10,
                      max_seq_len=8, tie_embeddings=tied)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert minillm_params(cfg) == tree_size(shapes)
    assert minillm_params(cfg) == 11 * 6 * (1 if tied else 2) + 3 * (2 * 6 * 16 + 2 * 6 * 8 + 3 * 6 * 10 + 12) + 6


def test_gpt2_small_u19_s3():
    assert gpt2_block_params(768) == 7_087_872
    assert 12 * gpt2_block_params(768) == 85_054_464
    assert gpt2_params(768, 12, 50_257, 1_024) == 124_439_808
    # "About 68 % sits in the blocks and 31 % in the token table."
    assert round(100 * 85_054_464 / 124_439_808) == 68
    assert round(100 * 50_257 * 768 / 124_439_808) == 31
    assert gpt2_params(768, 12, 50_257, 1_024, tied=False) - 124_439_808 == 38_597_376


def test_gpt2_medium_u19_problem4():
    assert gpt2_block_params(1_024) == 12_596_224
    assert gpt2_params(1_024, 24, 50_257, 1_024) == 354_823_168
    assert gpt2_params(1_024, 24, 50_257, 1_024, tied=False) == 406_286_336


def test_seven_b_class_u19_s3():
    assert approx_params(4_096, 32, 32_000) == 6_573_522_944
    assert approx_params(4_096, 32, 32_000) - 32_000 * 4_096 == 6_442_450_944
    assert round(100 * 6_442_450_944 / approx_params(4_096, 32, 32_000)) == 98  # "the blocks are 98 %"


def test_moe_layer_u19_s3():
    dense = moe_ffn_params(4_096, 1, 1)
    assert dense == (134_217_728, 134_217_728)
    assert moe_ffn_params(4_096, 8, 2) == (1_073_741_824, 268_435_456)
    assert moe_ffn_params(4_096, 8, 2, router=True).stored == 1_073_741_824 + 4_096 * 8


def test_moe_tower_u19_s3_widget():
    # "the tower grows to about 36.64 billion numbers, but a token uses only about 10.87 billion"
    for router in (False, True):
        count = moe_params(4_096, 32, 32_000, n_experts=8, top_k=2, router=router)
        assert round(count.stored / 1e9, 2) == 36.64
        assert round(count.active / 1e9, 2) == 10.87
    assert moe_params(4_096, 32, 32_000, 8, 2) == (36_638_294_016, 10_868_490_240)
    assert moe_params(4_096, 32, 32_000, 1, 1) == (approx_params(4_096, 32, 32_000),) * 2


def test_moe_u19_problem5():
    count = moe_ffn_params(2_048, 16, 2)
    assert count.stored // 16 == 33_554_432
    assert count == (536_870_912, 67_108_864)
    assert count.active * 8 == count.stored  # "one eighth of the stored experts"
    router = moe_ffn_params(2_048, 16, 2, router=True)
    assert router.stored - count.stored == 32_768 == router.active - count.active


def test_moe_rejects_top_k_above_experts():
    with pytest.raises(ConfigError, match="top_k = 3"):
        moe_ffn_params(16, 2, 3)


def test_lora_u19_s10():
    assert lora_params(4_096, 4_096, 8) == 65_536
    assert round(100 * 65_536 / 4_096**2, 2) == 0.39
    assert lora_params(24, 24, 8) == 384  # the widget: "384 numbers instead of 576"
    assert lora_model_params(4_096, 32, 8) == 4_194_304
    assert round(100 * 4_194_304 / approx_params(4_096, 32, 32_000), 2) == 0.06
    assert lora_params(1_024, 1_024, 4) == 8_192  # quick check
    assert lora_params(3, 3, 1) == 6  # "Six numbers describe nine"


def test_lora_u19_problem13():
    assert lora_params(8_192, 8_192, 16) == 262_144
    assert lora_model_params(8_192, 80, 16) == 41_943_040
    assert lora_params(3, 3, 2) == 12 > 9
    # (b) 2dr < d² exactly when r < d/2
    d = 4_096
    assert lora_params(d, d, 2_047) < d * d <= lora_params(d, d, 2_048)


def test_lora_on_minillm_matrices():
    cfg = ModelConfig(vocab_size=8, d_model=6, n_layers=2, n_heads=4, n_kv_heads=2, d_head=2, d_ff=5,
                      max_seq_len=4)
    assert lora_minillm_params(cfg, 3) == 2 * (3 * (6 + 8) + 3 * (6 + 4))
    assert lora_minillm_params(cfg, 1, ("w_down",)) == 2 * (5 + 6)
    with pytest.raises(ConfigError, match="w_q"):
        lora_minillm_params(cfg, 1, ("w_q",))


# ----- compute ---------------------------------------------------------------------------------------

def test_training_flops_u19_s8():
    assert training_flops(70e9, 1.4e12) == pytest.approx(5.88e23, rel=1e-12)
    assert training_flops(280e9, 300e9) == pytest.approx(5.04e23, rel=1e-12)
    assert training_flops(1e9, 20e9) == pytest.approx(1.2e20, rel=1e-12)  # quick check
    np.testing.assert_allclose(training_flops(np.array([1.0, 2.0]), 3.0), [18.0, 36.0])
    with pytest.raises(InputError):
        training_flops(0, 1e9)


def test_matmul_params_running_example():
    cfg, _, _, _ = examples.running_example()
    # W^Q, W^O: 2·(2·2); W^K, W^V: 2·(2·2); gate/up/down: 3·(2·2); U: 2·4.
    assert matmul_params(cfg) == 8 + 8 + 12 + 8
    tied, _, _, _ = examples.running_example(tie_embeddings=True)
    assert matmul_params(tied) == matmul_params(cfg)  # Λ = RU is a d×V product either way



def test_matmul_params_counts_mamba_projections_only():
    """d=8, I=16, N=4, R=1, W=4: projections 2·8·16 + 2·16·1 + 2·16·4 + 16·8 = 544 (of the mixer's 737
    parameters: the conv 4·16 + 16, Δ bias 16, A_log 16·4, D 16 and the norm 8 are elementwise); plus dV."""
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=1, max_seq_len=4, mixer_pattern=("mamba",),
                      ffn_pattern=("none",), ssm_state=4, tie_embeddings=True)
    assert cfg.mamba_param_count() == 544 + 4 * 16 + 16 + 16 + 16 * 4 + 16 + 8
    assert matmul_params(cfg) == 544 + 8 * 10

def test_train_flops_per_token_formula():
    cfg, _, _, _ = examples.running_example()
    assert train_flops_per_token(cfg, 3) == 6 * 36 + 12 * 1 * 3 * 1 * 2
    assert train_flops_per_token(cfg, 3, causal=True) == 6 * 36 + 6 * 1 * 4 * 1 * 2
    big = ModelConfig(vocab_size=32_000, d_model=4_096, n_layers=32, n_heads=32, n_kv_heads=32, d_head=128,
                      d_ff=11_008, max_seq_len=4_096)
    # The attention term is a small share at 4 096 tokens for a 7B-class model (U19 §8 proof).
    share = 1 - 6 * matmul_params(big) / train_flops_per_token(big, 4_096)
    assert 0.05 < share < 0.2


@pytest.mark.slow
def test_train_flops_per_token_matches_xla_count():
    """XLA's own count of one training step (value_and_grad of the loss) agrees with the formula.

    XLA also counts elementwise work (norms, softmax, SwiGLU), so agreement is to ~10 %. One layer: XLA's
    cost analysis counts the body of the layer scan once, whatever its trip count."""
    from mlx_llm import forward
    from mlx_llm.objectives.loss import masked_cross_entropy

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                      max_seq_len=64)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)

    def loss_fn(p, x):
        return masked_cross_entropy(forward(p, x, cfg), x, jnp.ones(x.shape))

    cost = jax.jit(jax.value_and_grad(loss_fn)).lower(params, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == pytest.approx(2 * 64 * train_flops_per_token(cfg, 64), rel=0.1)


# ----- KV cache --------------------------------------------------------------------------------------

def test_kv_rows_u19_s6():
    assert kv_rows(1_000, cached=False) == 500_500
    assert kv_rows(1_000, cached=True) == 1_000
    assert kv_rows(10, cached=False) == 55 and kv_rows(10, cached=True) == 10  # the widget
    assert kv_rows(2_000, cached=False) == 2_001_000  # quick check


def test_kv_rows_u19_problem9():
    assert kv_rows(4_096, cached=False) == 8_390_656
    assert kv_rows(4_096, cached=False) / kv_rows(4_096, cached=True) == 2_048.5
    assert kv_rows(1_413, cached=False) == 998_991 < 10**6 < kv_rows(1_414, cached=False) == 1_000_405


def test_kv_cache_running_example_m20_s14():
    cfg, _, _, _ = examples.running_example()
    assert kv_cache_scalars(cfg, 3) == 12
    assert kv_cache_bytes(cfg, 3, dtype=jnp.float32) == 48 == kv_cache_bytes(cfg, 3)
    assert kv_cache_bytes(cfg, 3, batch=4, dtype="bfloat16") == 96


@pytest.mark.parametrize("n_kv, expected", [(32, 2 * GIB), (8, 512 * MIB), (1, 64 * MIB)])
def test_kv_cache_seven_b_u19_s6(n_kv, expected):
    shape = KVShape(n_layers=32, n_kv_heads=n_kv, d_head=128)
    assert kv_cache_bytes(shape, 4_096, dtype=2) == expected
    cfg = ModelConfig(vocab_size=32_000, d_model=4_096, n_layers=32, n_heads=32, n_kv_heads=n_kv, d_head=128,
                      d_ff=11_008, max_seq_len=4_096)
    assert kv_cache_bytes(cfg, 4_096, dtype=jnp.bfloat16) == expected
    if n_kv == 32:
        assert kv_cache_bytes(shape, 1, dtype=2) == 524_288 == MIB // 2  # bytes per token


def test_kv_cache_u19_problem8():
    mha, gqa = KVShape(40, 40, 128), KVShape(40, 8, 128)  # L=40, d=5 120 = 40 heads of 128
    assert kv_cache_bytes(mha, 1, dtype=2) == 819_200
    assert kv_cache_bytes(mha, 8_192, dtype=2) == 6_710_886_400
    assert kv_cache_bytes(mha, 8_192, dtype=2) / GIB == 6.25
    assert kv_cache_bytes(gqa, 8_192, dtype=2) / GIB == 1.25
    assert (kv_cache_bytes(mha, 8_192, dtype=2) - kv_cache_bytes(gqa, 8_192, dtype=2)) / GIB == 5


def test_kv_cache_rejects_bad_input():
    with pytest.raises(InputError, match="seq_len"):
        kv_cache_scalars(KVShape(1, 1, 2), -1)
    with pytest.raises(InputError, match="batch"):
        kv_cache_scalars(KVShape(1, 1, 2), 3, batch=0)
    with pytest.raises(InputError, match="ModelConfig or KVShape"):
        kv_cache_scalars({"n_layers": 1}, 3)
    with pytest.raises(InputError, match="dtype"):
        bytes_per_scalar(object())
    assert bytes_per_scalar(8) == 8 and bytes_per_scalar("float16") == 2


def test_counts_reject_non_integers():
    with pytest.raises(InputError, match="d = 768.5"):
        gpt2_params(768.5, 12, 50_257, 1_024)
    with pytest.raises(InputError, match="L = True"):
        approx_params(4_096, True, 32_000)
