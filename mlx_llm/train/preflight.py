"""The pre-flight compiler (``mlx-llm compile``): the exact jitted train step, compiled ahead of time from abstract
shapes (no parameter is allocated), for the local devices or for a TPU topology, with its per-device memory.

A TPU target is compiled on this machine through ``jax.experimental.topologies.get_topology_desc`` and the
``libtpu`` wheel (the ``.[tpu]`` extra): the executable is the one a real slice would run, so
``memory_analysis()`` is its exact per-device memory. FLOPs come from ``scaling.accounting`` (XLA's cost
analysis does not count the FLOPs inside Pallas kernels). ``train`` runs the same check on the local devices
before it creates the run directory (``check_fits``).

Targets: ``local``, or ``tpu:<generation>-<N>`` with Google's names: N counts chips for v5e and v6e and
TensorCores for v4 and v5p (two per chip; ``tpu:v5p-8`` is 4 chips).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import jax

from mlx_llm.config import ModelConfig, TrainConfig, check_seq_len
from mlx_llm.errors import ConfigError
from mlx_llm.kernels import backend_platform
from mlx_llm.kernels.ssm_scan import resolve_ssm_scan
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.train.parallel import batch_devices, check_batch_divisible, make_mesh
from mlx_llm.train.step import (abstract_state, compile_lm_step, compile_update, compiled_steps, make_update,
                                 optimizer_for, placed_like, shapes_key, tracing_settings)

GiB = 2**30
# Per-device HBM that XLA's TPU compiler reports as available (its CompileTimeHbmOom message), and whether
# the generation's N counts TensorCores (two per chip, one JAX device per chip) or chips.
TPU_GENERATIONS = {"v4": (15.25 * GiB, "cores"), "v5e": (15.75 * GiB, "chips"), "v5p": (95.73 * GiB, "cores"),
                   "v6e": (31.24 * GiB, "chips")}
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
            512: "8x8x8"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # "local" or "tpu:v5e-4"
    devices: tuple
    platform: str  # "cpu", "gpu", "tpu"
    hbm_bytes_per_device: int


def valid_targets() -> list[str]:
    out = ["local"]
    for gen, (_, unit) in TPU_GENERATIONS.items():
        grid = _GRID_2D if gen in ("v5e", "v6e") else _GRID_3D
        out += [f"tpu:{gen}-{chips * (2 if unit == 'cores' else 1)}" for chips in grid]
    return out


def tpu_target(name: str) -> Target:
    """The devices of ``tpu:<gen>-<N>`` from libtpu's topology description (no TPU needed)."""
    gen, _, count = name.removeprefix("tpu:").partition("-")
    if gen not in TPU_GENERATIONS or not count.isdigit() or name not in valid_targets():
        raise ConfigError(f"unknown target {name!r}: valid targets are {valid_targets()}")
    hbm, unit = TPU_GENERATIONS[gen]
    chips = int(count) // (2 if unit == "cores" else 1)
    grid = (_GRID_2D if gen in ("v5e", "v6e") else _GRID_3D)[chips]
    try:
        import libtpu  # noqa: F401  (the wheel that compiles for TPUs)
    except ImportError:
        raise ConfigError(f"target {name!r} needs the libtpu wheel: pip install 'mlx_llm[tpu]'") from None
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only use; another process may hold libtpu
    from jax.experimental import topologies

    bounds = (1, 1, 1) if chips == 1 else (2, 2, 1)
    with without_cpu_flags():
        topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{gen}:{grid}",
                                            chip_config_name="default", chips_per_host_bounds=bounds, num_slices=1)
    return Target(name, tuple(topo.devices), "tpu", int(hbm))


@contextlib.contextmanager
def without_cpu_flags():
    """``XLA_FLAGS`` without XLA:CPU's own flags (``--xla_cpu_…``) while libtpu loads and compiles: libtpu parses
    the variable on first use and ends the whole process on a flag its XLA does not know
    (``--xla_cpu_use_fusion_emitters`` is one), while XLA:CPU read its flags when the CPU backend started.
    Restored after."""
    flags = os.environ.get("XLA_FLAGS")
    if flags is None:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags.split() if not f.startswith("--xla_cpu_"))
    try:
        yield
    finally:
        os.environ["XLA_FLAGS"] = flags


def local_target() -> Target:
    """Every device of the run (all processes'); memory per device from the backend (GPU), else the host's RAM
    over this process's devices."""
    devices, mine = tuple(jax.devices()), jax.local_devices()  # only this process's devices report memory
    limit = (mine[0].memory_stats() or {}).get("bytes_limit")
    if limit is None:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(mine)
    return Target("local", devices, backend_platform(devices[0].platform), int(limit))


def resolve_target(name: str) -> Target:
    if name == "local":
        return local_target()
    if name.startswith("tpu:"):
        return tpu_target(name)
    raise ConfigError(f"unknown target {name!r}: valid targets are {valid_targets()}")


def compile_step(cfg: ModelConfig, tcfg: TrainConfig, target: str | Target = "local", *, trainable=None,
                 frozen=None, model_of=None, mask_id: int | None = None) -> dict:
    """Compile the run's language-model step for ``target`` from abstract shapes and report it (one dict: the
    keys of ``mlx-llm compile --json``). Nothing is allocated on any device. ``trainable``, ``frozen``,
    ``model_of``: a part trained beside a frozen model (``train.step.compile_lm_step``)."""
    return _compile(cfg, tcfg, target, trainable, frozen, model_of, mask_id)[0]


def compiled_step(cfg: ModelConfig, tcfg: TrainConfig, target: str | Target = "local") -> tuple:
    """(``compile_step``'s report, the compiled step it describes: (state, batch, None) → (state, metrics), or None
    when XLA refused it), so a measurement runs the very program whose memory was predicted
    (experiments/device_check.py compares the report with the device's peak)."""
    return _compile(cfg, tcfg, target, None, None, None, None)


def _compile(cfg: ModelConfig, tcfg: TrainConfig, target, trainable, frozen, model_of, mask_id) -> tuple:
    """(``compile_step``'s report, the compiled step, or None when XLA refused it). For a TPU target, libtpu
    (which reads ``XLA_FLAGS`` at its first compile) sees the flags without XLA:CPU's (``without_cpu_flags``)."""
    check_seq_len(cfg, tcfg)  # a window longer than the model's positions does not fit, whatever the memory
    tpu = (target if isinstance(target, str) else target.platform).startswith("tpu")
    with without_cpu_flags() if tpu else contextlib.nullcontext():
        target = resolve_target(target) if isinstance(target, str) else target
        kernels = tcfg.kernels(target.platform, resolve=True)  # refuses a kernel the target cannot run
        mesh = make_mesh(tcfg.mesh, target.devices)
        check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, mesh)
        if tcfg.objective == "diffusion" and mask_id is None:
            mask_id = cfg.vocab_size - 1  # any valid id: the shapes are what is compiled
        compiled = compile_or_explain(lambda: compile_lm_step(cfg, tcfg, mesh, mask_id, trainable=trainable,
                                                              frozen=frozen, model_of=model_of))
    out = report(cfg, tcfg, target, mesh, compiled, kernels)
    out["state_bytes_per_device"] = state_bytes_per_device(placed_like(abstract_state(cfg, tcfg, trainable), mesh))
    return out, None if isinstance(compiled, _Refused) else compiled


def state_bytes_per_device(state) -> int:
    """Bytes of the train state (parameters or adapters, optimizer moments) on one device, from each array's
    shard shape (``param_spec`` splits only evenly): the part of ``arguments`` resident between steps."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(state))


def compile_or_explain(compile_fn):
    """``compile_fn()``; XLA's compile-time out-of-memory becomes a report that does not fit."""
    try:
        return compile_fn()
    except Exception as exc:  # XlaRuntimeError: RESOURCE_EXHAUSTED … CompileTimeHbmOom
        text = str(exc)
        if "RESOURCE_EXHAUSTED" in text or "HbmOom" in text:
            return _Refused(text.strip().splitlines()[0])
        raise


@dataclasses.dataclass
class _Refused:
    """A program XLA refused to compile because it needs more memory than a device has."""

    message: str

    def memory_analysis(self):
        return None


def report(cfg: ModelConfig, tcfg: TrainConfig, target: Target, mesh, compiled, kernels) -> dict:
    mem = compiled.memory_analysis()
    tokens = tcfg.batch_size * tcfg.seq_len
    out = {"target": target.name, "platform": target.platform, "devices": len(target.devices),
           "mesh": dict(mesh.shape), "hbm_bytes_per_device": target.hbm_bytes_per_device,
           "tokens_per_step": tokens, "flops_per_step": train_flops_per_token(cfg, tcfg.seq_len, causal=True) * tokens,
           "attention_impl": kernels.attention_impl, "moe_impl": kernels.moe_impl, "loss_chunk": kernels.loss_chunk,
           "ssm_scan": resolved_ssm_scan(cfg, target.platform), "remat": tcfg.remat,
           "compute_dtype": tcfg.compute_dtype, "batch_size": tcfg.batch_size, "seq_len": tcfg.seq_len}
    if mem is None:
        out.update(bytes_per_device=None, fits=False, refused=compiled.message)
        return out
    sizes = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
             "aliased": mem.alias_size_in_bytes, "temporary": mem.temp_size_in_bytes}
    sizes["total"] = sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporary"]
    out.update(bytes_per_device=sizes, fits=sizes["total"] <= target.hbm_bytes_per_device)
    try:
        out["kernels_in_program"] = kernels_in_program(compiled.as_text())
    except jax.errors.JaxRuntimeError:  # XLA cannot print every TPU executable (seen: an 8B step on v5p)
        out["kernels_in_program"] = None
    return out


def resolved_ssm_scan(cfg: ModelConfig, platform: str) -> str | None:
    if "mamba" not in cfg.mixer_pattern:
        return None
    return resolve_ssm_scan(cfg.ssm_scan, platform)


def kernels_in_program(hlo_text: str) -> list[str]:
    """The custom kernels a compiled program calls (Mosaic TPU kernels by name, Triton GPU kernels)."""
    found = set()
    for marker, name in (("splash", "splash_attention"), ("gmm", "megablox_gmm"), ("tgmm", "megablox_tgmm"),
                         ("__gpu$xla.gpu.triton", "triton")):
        if marker in hlo_text and ("tpu_custom_call" in hlo_text or "triton" in marker):
            found.add(name)
    return sorted(found)


def advice(out: dict) -> str:
    """One line: by how much a step does not fit, and which settings would help."""
    if out.get("refused"):
        need = out["refused"]
    else:
        over = out["bytes_per_device"]["total"] - out["hbm_bytes_per_device"]
        need = (f"needs {out['bytes_per_device']['total'] / GiB:.2f} GiB per device, {over / GiB:.2f} GiB more than "
                f"the {out['hbm_bytes_per_device'] / GiB:.2f} GiB of {out['target']}")
    knobs = []
    if out["mesh"].get("fsdp", 1) < out["devices"]:
        knobs.append("shard parameters and optimizer state with --mesh fsdp=N")
    if out["remat"] != "full":
        knobs.append("--remat full")
    if out["attention_impl"] == "xla":
        knobs.append("--attention-impl flash (no (B, T, T) scores)")
    if not out["loss_chunk"]:
        knobs.append("--loss-chunk auto (no (B, T, V) logits)")
    knobs.append(f"a smaller --batch-size than {out['batch_size']} (with --grad-accum to keep the tokens per step)")
    return f"the train step does not fit: {need}; try " + ", ".join(knobs)


def check_compiled_fits(compiled, what: str) -> None:
    """Refuse (``ConfigError``, one line) a compiled step whose memory exceeds a local device's: the pre-flight of
    the runs whose step is not the language model's (reward, DPO, RL: post/)."""
    mem, target = compiled.memory_analysis(), local_target()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    if total > target.hbm_bytes_per_device:
        raise ConfigError(f"the {what} step does not fit: it needs {total / GiB:.2f} GiB per device, "
                          f"{(total - target.hbm_bytes_per_device) / GiB:.2f} GiB more than the "
                          f"{target.hbm_bytes_per_device / GiB:.2f} GiB here; try LoRA (--lora-rank) or a smaller "
                          f"--batch-size")


def compiled_update(cfg: ModelConfig, tcfg: TrainConfig, objective, trainable, frozen, example_batch, *,
                    offsets=None, count_name: str = "pairs", epochs: int = 1, minibatches: int = 1):
    """A run's update (``train.step.make_update`` of ``objective``) compiled on the mesh of ``tcfg`` by the one
    compile path (``train.step.compile_update``) and checked against the devices' memory before the run writes
    anything: a step that cannot fit is refused in one line. ``example_batch``: one batch as the batch source
    gives it; ``epochs`` × ``minibatches``: the optimizer updates of one step (PPO's passes over a rollout). The
    compiled update is kept for the next run of this process with the same arguments (``train.step.compiled_steps``:
    the same ``objective`` and ``offsets`` functions, which their makers return again for the same settings, the same
    configs, mesh, tree shapes and jax settings): a resumed or repeated run compiles it once."""
    mesh = make_mesh(tcfg.mesh)
    rows = jax.tree.leaves(example_batch)[0].shape[0]  # pairs, or RL's prompts × replies
    check_batch_divisible(rows // minibatches, tcfg.grad_accum, mesh)

    def build():
        update = make_update(objective, tcfg, optimizer_for(tcfg, epochs * minibatches, cfg=cfg), offsets=offsets,
                             count_name=count_name, epochs=epochs, minibatches=minibatches, n_layers=cfg.n_layers)
        return compile_update(update, abstract_state(cfg, tcfg, trainable), frozen, example_batch, mesh)

    key = (cfg, tcfg, objective, offsets, count_name, epochs, minibatches, mesh, shapes_key(trainable),
           shapes_key(frozen), shapes_key(example_batch), tracing_settings())
    compiled = compiled_steps.get(key, build)
    check_compiled_fits(compiled, "update")
    return compiled


def check_fits(cfg: ModelConfig, tcfg: TrainConfig, *, trainable=None, frozen=None, model_of=None, mask_id=None):
    """The run's language-model step compiled on the local devices (``compile_step``), for the training loop to
    run; a step that cannot fit is refused (``ConfigError``) before any work, with the numbers and the knobs that
    help."""
    out, compiled = _compile(cfg, tcfg, "local", trainable, frozen, model_of, mask_id)
    if not out["fits"]:
        raise ConfigError(advice(out))
    return compiled


def format_report(out: dict) -> str:
    """The human-readable table of ``mlx-llm compile``."""
    rows = [f"target {out['target']}: {out['devices']} device(s), mesh {out['mesh']}, "
            f"{out['hbm_bytes_per_device'] / GiB:.2f} GiB per device"]
    rows.append(f"kernels: attention {out['attention_impl']}, moe {out['moe_impl']}, loss_chunk "
                f"{out['loss_chunk']}, ssm_scan {out['ssm_scan']}; remat {out['remat']}, {out['compute_dtype']}")
    if out["bytes_per_device"] is None:
        rows.append(f"XLA refused the program: {out['refused']}")
    else:
        rows.append(f"  parameters + optimizer state: {out['state_bytes_per_device'] / GiB:9.3f} GiB per device")
        for k in ("arguments", "outputs", "aliased", "temporary", "total"):
            rows.append(f"  {k:>28}: {out['bytes_per_device'][k] / GiB:9.3f} GiB per device")
        rows.append(f"fits: {'yes' if out['fits'] else 'no'} "
                    f"({100 * out['bytes_per_device']['total'] / out['hbm_bytes_per_device']:.1f} % of HBM)")
    rows.append(f"per step: {out['tokens_per_step']:,} tokens, {out['flops_per_step']:.3e} FLOPs "
                f"({out['flops_per_step'] / max(out['devices'], 1):.3e} per device)")
    if out.get("kernels_in_program"):
        rows.append(f"custom kernels in the program: {', '.join(out['kernels_in_program'])}")
    return "\n".join(rows)


def largest_batch(cfg: ModelConfig, tcfg: TrainConfig, target: str | Target, *, limit: int = 1024) -> int:
    """The largest batch size (a multiple of the batch shards, doubling then bisecting) whose step fits."""
    target = resolve_target(target) if isinstance(target, str) else target
    unit = batch_devices(make_mesh(tcfg.mesh, target.devices)) * tcfg.grad_accum
    fits = lambda n: compile_step(cfg, dataclasses.replace(tcfg, batch_size=n * unit), target)["fits"]  # noqa: E731
    lo, hi = 0, 1
    while hi * unit <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit

