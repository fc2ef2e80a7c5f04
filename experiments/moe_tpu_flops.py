"""Compiled FLOPs of the MoE routed experts on a TPU topology, per dispatch path, against the active FLOPs.

The routed-expert product (forward + backward of Σ_e w_e SwiGLU_e over N tokens, k of X experts each) is compiled
for ``tpu:v5e-4`` (libtpu, no TPU needed) with the tokens split over a 4-way ``data`` mesh, under the same abstract
mesh the train step sets, for "block", "ragged_dot" and "megablox". Active FLOPs: 3 products × 2·N·k·D·F forward,
×3 for training, per device N/4 tokens. XLA's cost analysis counts a Pallas kernel by the cost it declares
(megablox: 2·M·K·N of its padded grid), so the megablox figure is the kernel's own account.

    python -m experiments.moe_tpu_flops [--tokens 4096 --d-model 512 --d-ff 256 --experts 8 --top-k 2]

Writes experiments/results/moe_tpu_flops.json (``--save``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from experiments import common  # noqa: E402
from mlx_llm.layers.moe import routed_experts  # noqa: E402
from mlx_llm.train.preflight import tpu_target  # noqa: E402


def compiled_flops(impl: str, mesh: Mesh, n: int, d: int, f: int, x: int, k: int) -> float:
    def loss(y, w, layer, ids):
        return jnp.sum(routed_experts(y, ids, w, layer, impl).astype(jnp.float32))

    def step(y, w, layer, ids):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.grad(loss, (0, 1, 2))(y, w, layer, ids)

    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    sds = jax.ShapeDtypeStruct
    layer = {"expert_gate": sds((x, d, f), jnp.bfloat16, sharding=whole),
             "expert_up": sds((x, d, f), jnp.bfloat16, sharding=whole),
             "expert_down": sds((x, f, d), jnp.bfloat16, sharding=whole)}
    args = (sds((n, d), jnp.bfloat16, sharding=rows), sds((n, k), jnp.float32, sharding=rows), layer,
            sds((n, k), jnp.int32, sharding=rows))
    compiled = jax.jit(step).lower(*args).compile()
    return float(compiled.cost_analysis()["flops"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    common.add_save_argument(ap, "moe_tpu_flops")
    a = ap.parse_args()
    devices = tpu_target("tpu:v5e-4").devices
    mesh = Mesh(np.asarray(devices).reshape(4), ("data",))
    active = 3 * 3 * 2 * (a.tokens // 4) * a.top_k * a.d_model * a.d_ff  # per device, forward + backward
    print(f"tpu:v5e-4, data=4, N={a.tokens}, D={a.d_model}, F={a.d_ff}, X={a.experts}, k={a.top_k}; "
          f"active FLOPs per device {active:.3e}")
    compiled = {}
    for impl in ("block", "ragged_dot", "megablox"):
        compiled[impl] = flops = compiled_flops(impl, mesh, a.tokens, a.d_model, a.d_ff, a.experts, a.top_k)
        print(f"{impl:>10}: compiled {flops:.3e} FLOPs per device = {flops / active:.2f}x active")
    common.save_from_args(a, {"args": common.arguments(a), "target": "tpu:v5e-4", "mesh": "data=4",
                              "active_flops_per_device": active, "compiled_flops_per_device": compiled,
                              "compiled_over_active": {k: v / active for k, v in compiled.items()}})


if __name__ == "__main__":
    main()
