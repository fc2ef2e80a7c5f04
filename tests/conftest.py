"""Test-session setup: float64 everywhere so the seeds' 6–9 digit numbers can be asserted exactly.

Tests of float32 / bfloat16 paths pass explicit dtypes. The library itself never changes jax.config.
"""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")
