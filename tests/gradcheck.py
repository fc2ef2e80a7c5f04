"""Shared helpers of the gradient tests (test_grads.py, test_grads_moe.py)."""

import functools

import jax
import numpy as np

REL = 1e-10
# These graphs are tiny and each is run once or twice: XLA's optimisation passes cost more than they save.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                   "xla_llvm_disable_expensive_passes": True})


def assert_close(got, want, rel=REL, what=""):
    """Norm-relative check per array: max|a − b| ≤ rel · max(1, max|b|)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, scale = np.max(np.abs(got - want)), max(1.0, np.max(np.abs(want)))
    assert err <= rel * scale, f"{what}: max|diff| = {err:.3e}, scale = {scale:.3e}"
