"""Test-session setup: float64 everywhere so the seeds' 6–9 digit numbers can be asserted exactly.

Tests of float32 / bfloat16 paths pass explicit dtypes. The library itself never changes jax.config.
"""

import jax
import pytest

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")


@pytest.fixture(scope="session")
def base_run(tmp_path_factory):
    """A tiny byte-level pretrained run (tests/tiny_runs.py), shared by the fine-tuning tests."""
    from tiny_runs import pretrain

    return pretrain(tmp_path_factory.mktemp("base"))
