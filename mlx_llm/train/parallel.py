"""The device mesh and every sharding of training, declared once (DESIGN §1: jit + NamedSharding, no pmap).

The mesh has three axes: ``data`` (batch rows only), ``fsdp`` (batch rows, and parameters plus optimizer
moments split along it, ZeRO-3 style: XLA gathers each layer's weights when the scan reaches it and
reduce-scatters their gradients) and ``tensor`` (attention heads, FFN/SSM columns and the vocabulary split
Megatron style). The CLI spells it ``--mesh data=2,fsdp=4``; the default puts every device on ``data``.

``param_spec`` is the one function from a parameter path and shape to its ``PartitionSpec``; init, the train
step, checkpoints (orbax restores into whatever shardings the target asks for) and evaluation all use it
through ``tree_shardings``. The rule, per array:

1. Arrays under ``blocks`` are stacked over layers (or layer groups) on axis 0: that axis is never split,
   because the forward scans over it.
2. ``tensor`` takes the axis named in ``TENSOR_AXIS`` for the key (heads of ``wq wk wv wo``; the FFN width m of
   ``w_gate w_up w_down`` and of the experts; the SSM inner width I of every Mamba matrix; the vocabulary of
   ``embed``/``unembed``) when the tensor size divides it; other keys are replicated over ``tensor``. The axes
   are the ``tensor_axis`` of each key's declaration in ``layers.layout``.
3. ``fsdp`` takes the largest remaining axis that it divides (the first of equal ones); an array with no such
   axis (norm gains, scalars, a dimension too small) is replicated over ``fsdp``.

Optimizer moments mirror the parameter tree, so the same rule (keyed by the last dict key in the path) shards
them alike; LoRA adapters (``A``, ``B``) follow rules 1 and 3.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mlx_llm.config import MESH_AXES, parse_mesh
from mlx_llm.errors import ConfigError
from mlx_llm.layers import layout

BATCH_AXES = ("data", "fsdp")

# Axis (counted without the stacked layer axis) that ``tensor`` splits, per parameter key: the ``tensor_axis``
# of each key's declaration in ``layers.layout``.
TENSOR_AXIS = layout.tensor_axes()


def make_mesh(spec: str = "", devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (default: every device of every process).

    ``spec`` is ``"data=2,fsdp=4"``-style (config.parse_mesh); axes left out have size 1, and one axis may be
    ``-1`` (whatever the others leave). An empty spec puts every device on ``data``.
    """
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(spec, len(devices))
    auto = (AxisType.Auto,) * len(MESH_AXES)  # shardings propagate through the step (GSPMD), not in types
    if devices == jax.devices():
        return jax.make_mesh(shape, MESH_AXES, auto, devices=devices)  # topology-aware order on GPU/TPU
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def mesh_shape(spec: str, n_devices: int) -> tuple[int, ...]:
    """Axis sizes of ``spec`` for ``n_devices`` devices, with a clear error when they do not multiply out."""
    sizes = parse_mesh(spec) or {"data": -1}
    free = [a for a, s in sizes.items() if s == -1]
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise ConfigError(f"mesh {spec!r}: the fixed axes use {fixed} devices, which does not divide the "
                              f"{n_devices} device(s) available")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"mesh {spec!r} has {math.prod(sizes.values())} devices but {n_devices} are available: "
                          f"the axis sizes must multiply to the device count (or give one axis as -1)")
    return tuple(sizes.get(a, 1) for a in MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data`` × ``fsdp``, replicated over ``tensor``."""
    return NamedSharding(mesh, P(BATCH_AXES))


def batch_devices(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def param_spec(keys: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of one array (rules 1–3 of the module docstring); ``keys`` are its path's dict keys."""
    if not shape:
        return P()
    parts: list[Any] = [None] * len(shape)
    first = 1 if "blocks" in keys else 0
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    name = keys[-1] if keys else ""
    if tensor > 1 and name in TENSOR_AXIS and first + TENSOR_AXIS[name] < len(shape):
        axis = first + TENSOR_AXIS[name]
        if shape[axis] % tensor == 0:
            parts[axis] = "tensor"
    if fsdp > 1:
        free = [a for a in range(first, len(shape)) if parts[a] is None and shape[a] % fsdp == 0]
        if free:
            parts[max(free, key=lambda a: (shape[a], -a))] = "fsdp"
    return P(*parts)


def _dict_keys(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings of every array of ``tree`` (parameters, a TrainState, LoRA adapters) by ``param_spec``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, param_spec(_dict_keys(path), tuple(np.shape(a)), mesh)), tree)


def shard_tree(tree: Any, mesh: Mesh) -> Any:
    """``tree`` placed on the mesh by ``tree_shardings``."""
    return jax.device_put(tree, tree_shardings(tree, mesh))


def check_batch_divisible(batch_size: int, grad_accum: int, mesh: Mesh) -> None:
    n = batch_devices(mesh)
    micro = batch_size // grad_accum
    if micro % n:
        raise ConfigError(
            f"batch_size = {batch_size} (micro-batch {micro} with grad_accum = {grad_accum}) cannot be split over "
            f"the {n} batch shards of the mesh (data × fsdp): the micro-batch must be a multiple of {n} (e.g. "
            f"batch_size = {grad_accum * n * max(1, round(micro / n))})"
        )


def local_rows(mesh: Mesh, global_batch: int) -> slice:
    """The rows of a global batch that this process's devices hold (all rows with one process), so each
    process reads only its part of the data."""
    index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
    starts = sorted({idx[0].indices(global_batch)[:2] for idx in index_map.values()})
    lo, hi = starts[0][0], starts[-1][1]
    if sum(b - a for a, b in starts) != hi - lo:
        raise ConfigError(f"this process's batch shards {starts} are not one contiguous block of rows")
    return slice(lo, hi)


def global_batch(local: dict, mesh: Mesh, global_size: int, keys) -> dict:
    """Global arrays from this process's rows (``local_rows``) of each batch array in ``keys``."""
    sharding = batch_sharding(mesh)
    out = {}
    for k in keys:
        a = np.asarray(local[k])
        out[k] = jax.make_array_from_process_local_data(sharding, a, (global_size, *a.shape[1:]))
    return out


# ----- several processes (several machines) -------------------------------------------------------------------
def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-process run (``jax.distributed.initialize``) before JAX touches any device.

    Explicit values win; else ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` from the
    environment; with none of them set JAX's own cluster detection runs (SLURM, Open MPI, Cloud TPU, …). After it,
    ``jax.devices()`` lists every process's devices and the default mesh spans them all.
    """
    import os

    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"number of processes = {num_processes} is invalid: it must be >= 1")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"process id = {process_id} is invalid: it must be in [0, {num_processes})")
    if jax.distributed.is_initialized():  # (jax.process_count() here would start the backend: it must come after)
        return
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    except (ValueError, RuntimeError) as exc:  # nothing detected, or the coordinator unreachable
        raise ConfigError(f"cannot join a multi-process run ({str(exc).strip().splitlines()[0]}): give --coordinator "
                          f"HOST:PORT --num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES "
                          f"and JAX_PROCESS_ID), or run under a cluster manager JAX detects (SLURM, Open MPI, "
                          f"Cloud TPU)") from None


def _env_int(name: str) -> int | None:
    import os

    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} = {value!r} is not an integer") from None


def is_main_process() -> bool:
    """Process 0 alone writes run files, metrics, plots and the sample; every process takes part in the
    steps, evaluations and (orbax's collective) checkpoints."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather_to_host(tree: Any) -> Any:
    """Whole arrays in every process (NumPy, all-gathered across processes); with one process, ``tree`` as is."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def agree(value: int) -> int:
    """Process 0's value of a host-side integer, in every process (a measured step count, say)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))
