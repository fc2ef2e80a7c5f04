"""Device mesh and shardings for data-parallel training (DESIGN §1: jit + NamedSharding, no pmap).

The mesh has two axes: ``data`` (batch rows) and ``fsdp`` (size 1 today; reserved for sharding parameters and
optimizer state along it later). Parameters are replicated; the batch is split over both axes.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mlx_llm.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


def make_mesh(devices=None) -> Mesh:
    """All local devices (or ``devices``) on the ``data`` axis, ``fsdp`` of size 1."""
    devices = np.asarray(jax.local_devices() if devices is None else devices)
    return Mesh(devices.reshape(-1, 1), BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every device of the mesh."""
    return NamedSharding(mesh, P(BATCH_AXES))


def check_batch_divisible(batch_size: int, grad_accum: int, mesh: Mesh) -> None:
    n = mesh.devices.size
    micro = batch_size // grad_accum
    if micro % n:
        raise ConfigError(
            f"batch_size = {batch_size} (micro-batch {micro} with grad_accum = {grad_accum}) cannot be split over "
            f"{n} devices: the micro-batch must be a multiple of the device count (e.g. batch_size = "
            f"{grad_accum * n * max(1, round(micro / n))})"
        )
