"""Seeds never collide (issue 51): every accepted seed, 0 to 2**63 - 1, gives its own draw — the parameters
(``--seed``, ``--init-seed``), LoRA adapters, the data order (``--data-seed``), sampling (``generate``, the diffusion
samplers) — and the same draw whether x64 is on (this process) or off (the command line). jax's own seeding keeps
only the low 32 bits of a seed when x64 is off, so seed 2**32 drew seed 0's numbers there; ``ops.seed_key`` builds
the key from both 32-bit words, and a seed below 2**32 keeps the key jax gives it (no earlier result changes)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import config as config_lib
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.ops import SEED_MAX, seed_key, seed_key_data
from helpers import python, tiny_cfg, tiny_train

BIG = 2**32
SMALL_SEEDS = (0, 5, 2**31 - 1, 2**31, 2**32 - 1)
PAIRS = ((0, BIG), (5, BIG + 5))  # equal low words: jax without x64 gave each pair one draw

# What a seed draws, everywhere a seed is used: run in this process (x64 on) and in a fresh one (x64 off).
DRAWS = r"""
import json, sys
from types import SimpleNamespace
import jax, numpy as np
if sys.argv[1] == "x64":
    jax.config.update("jax_enable_x64", True)
from mlx_llm.config import LoRAConfig, ModelConfig, TrainConfig
from mlx_llm.data.packing import window_starts
from mlx_llm.data.text import epoch_order
from mlx_llm.decode.diffusion import sample
from mlx_llm.decode.generate import generate
from mlx_llm.model import init_params
from mlx_llm.ops import seed_key_data
from mlx_llm.post.prologue import initial_trainable

from mlx_llm.train.step import init_state, optimizer_for

cfg = ModelConfig(**json.loads(sys.argv[2]))
denoiser = ModelConfig(**{**json.loads(sys.argv[2]), "causal": False})
denoiser_params = init_params(denoiser, jax.random.key(0))
tcfg = TrainConfig(batch_size=4, seq_len=8, steps=4, warmup_steps=1)
opt = optimizer_for(tcfg)

def total(tree):
    return float(sum(np.abs(np.asarray(a, np.float64)).sum() for a in jax.tree.leaves(tree)))

def draws(seed):
    state = init_state(cfg, TrainConfig(**{**tcfg.to_dict(), "seed": seed}), opt)
    init = init_state(cfg, TrainConfig(**{**tcfg.to_dict(), "init_seed": seed}), opt)
    lora = initial_trainable(SimpleNamespace(params=state.params), LoRAConfig(rank=2), seed)
    tokens = generate(state.params, cfg, np.array([[1, 2]]), 12, temperature=1.0, seed=seed).tokens
    diffused = sample(denoiser_params, denoiser, np.array([[1, 2]]), 12, steps=4, mask_id=denoiser.vocab_size - 1,
                      seed=seed)
    return {"key": np.asarray(seed_key_data(seed)).tolist(), "diffusion": np.asarray(diffused).tolist(), "params": total(state.params),
            "rng": np.asarray(state.rng).tolist(), "init_seed": total(init.params), "lora": total(lora),
            "tokens": np.asarray(tokens).tolist(), "windows": window_starts(10**6, 3, batch_size=4, seq_len=8,
                                                                           seed=seed).tolist(),
            "order": epoch_order(0, 8, 100, seed).tolist()}

print(json.dumps({s: draws(int(s)) for s in sys.argv[3:]}))
"""
SEEDS = sorted({s for pair in PAIRS for s in pair})


def _draws(x64: bool) -> dict:
    cfg = json.dumps(tiny_cfg().to_dict())
    proc = python("-c", DRAWS, "x64" if x64 else "x32", cfg, *SEEDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def draws_x32():
    return _draws(x64=False)


# ----- the key ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SMALL_SEEDS)
def test_a_seed_below_2_32_keeps_jax_key(seed):
    """No earlier result changes: the typed key and the raw key are jax's own for every 32-bit seed."""
    mine, theirs = seed_key(seed), jax.random.key(seed)
    assert mine.dtype == theirs.dtype
    np.testing.assert_array_equal(jax.random.key_data(mine), jax.random.key_data(theirs))
    np.testing.assert_array_equal(jax.random.normal(mine, (4,)), jax.random.normal(theirs, (4,)))
    raw = seed_key_data(seed)
    assert raw.dtype == jax.random.PRNGKey(seed).dtype == jnp.uint32
    np.testing.assert_array_equal(raw, jax.random.PRNGKey(seed))


def test_the_key_holds_both_words():
    assert np.asarray(seed_key_data(BIG)).tolist() == [1, 0]
    assert np.asarray(seed_key_data(BIG + 5)).tolist() == [1, 5]
    assert np.asarray(seed_key_data(SEED_MAX)).tolist() == [2**31 - 1, 2**32 - 1]
    assert np.asarray(seed_key_data(np.int64(BIG + 5))).tolist() == [1, 5]
    traced = jax.jit(jax.vmap(seed_key_data))(jnp.asarray([5, BIG + 5], jnp.int64))  # bandit.train's path
    assert np.asarray(traced).tolist() == [[0, 5], [1, 5]]


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**64, True, 1.5])
def test_a_seed_out_of_range_is_refused(seed):
    with pytest.raises(InputError, match="seed .* is invalid"):
        seed_key_data(seed)


def test_every_seed_setting_has_one_range():
    assert config_lib.SEED_MAX == SEED_MAX == 2**63 - 1
    for name in ("seed", "init_seed", "data_seed"):
        assert getattr(tiny_train(**{name: SEED_MAX}), name) == SEED_MAX
        with pytest.raises(ConfigError, match=f"TrainConfig.{name} = {SEED_MAX + 1} is invalid"):
            tiny_train(**{name: SEED_MAX + 1})


def test_generate_refuses_a_seed_out_of_range():
    from mlx_llm.decode.generate import generate

    cfg = tiny_cfg()
    for seed in (-1, SEED_MAX + 1):
        with pytest.raises(InputError, match=f"seed = {seed} is invalid: it must be an integer in \\[0, "):
            generate({}, cfg, np.array([[1, 2]]), 2, beam_width=2, seed=seed)  # refused before the params are read


# ----- every draw, with x64 off (the command line) and on (this suite) ----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("what", ["key", "params", "rng", "init_seed", "lora", "tokens", "diffusion", "windows",
                                  "order"])
def test_seeds_with_equal_low_words_draw_differently(draws_x32, what):
    """Seed 2**32 (2**32 + 5) draws other parameters, state noise, adapters, samples and data order than seed 0
    (5) where x64 is off; before, jax's seeding gave each pair one draw there."""
    for a, b in PAIRS:
        assert draws_x32[a][what] != draws_x32[b][what], (a, b)


@pytest.mark.slow
def test_a_seed_draws_the_same_with_and_without_x64(draws_x32):
    """The command line (x64 off) and a float64 process draw the same keys, state noise, samples and data for
    every seed; the parameters and adapters agree to float32 rounding (x64 changes how the init scale is computed,
    not the draw). The diffusion samplers draw their uniforms in the default float width, so their samples
    differ with x64 even for seed 0: only their keys are compared."""
    x64 = _draws(x64=True)
    for seed in SEEDS:
        for what in ("key", "rng", "tokens", "windows", "order"):
            assert x64[seed][what] == draws_x32[seed][what], (seed, what)
        for what in ("params", "init_seed", "lora"):
            assert x64[seed][what] == pytest.approx(draws_x32[seed][what], rel=1e-5), (seed, what)

