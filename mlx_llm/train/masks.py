"""Which parameters the optimizer treats how, read from each leaf's declaration in ``layers/layout.py``: the decay
mask of AdamW (M20 §12), the routing state that no gradient optimizer touches (M20 §15) and the learning-rate
multiplier of each leaf's group (``role_lr_scales``). Shared by the AdamW chain (``optim``) and Muon (``muon``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mlx_llm.errors import ConfigError
from mlx_llm.layers import layout

ROUTING_STATE_KEYS = ("router_offset",)


def key_name(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", entry)))


def declared(path: tuple[str, ...]) -> layout.ParamInfo:
    """The layout entry a leaf belongs to: the deepest key of its path that the layout declares (a LoRA
    adapter ``blocks/wq/A`` belongs to ``wq``)."""
    infos = layout.entries()
    for key in reversed(path):
        if key in infos:
            return infos[key]
    raise ConfigError(f"decay_mask: the parameter {'/'.join(path)!r} is not declared in layers/layout.py, so "
                      f"whether it decays is unknown; declare it there")


def decay_mask(params):
    """True where AdamW applies weight decay: exactly the weight matrices (``layout.ParamInfo.decayed``:
    embeddings and projections, Mamba's conv kernel), never a norm gain, a bias, A_log or D.

    Decided by each leaf's declared layout entry, not by its rank: stacked gains are (L, d) arrays and A_log
    is (I, N), yet neither decays. Works for uniform blocks (a dict), mixed stacks (a list of dicts), LoRA
    adapters and the heads trained beside a model (``layout.HEADS``).
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: declared(tuple(key_name(e) for e in path)).decayed, params)


def strip_routing_state(tree):
    """θ alone: the tree without its routing-state leaves (MoE balancing offsets, M20 §15)."""
    if isinstance(tree, dict):
        return {k: strip_routing_state(v) for k, v in tree.items() if k not in ROUTING_STATE_KEYS}
    if isinstance(tree, (list, tuple)):
        return type(tree)(strip_routing_state(v) for v in tree)
    return tree


def _restore_routing_state(theta, like, fill):
    """``theta`` with the routing-state leaves of ``like`` put back as ``fill(leaf)``."""
    if isinstance(like, dict):
        return {k: fill(v) if k in ROUTING_STATE_KEYS else _restore_routing_state(theta[k], v, fill)
                for k, v in like.items()}
    if isinstance(like, (list, tuple)):
        return type(like)(_restore_routing_state(t, v, fill) for t, v in zip(theta, like))
    return theta


def exclude_routing_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run ``inner`` on θ only: routing state gets no moments, no clipping share, no decay and a zero update
    (M20 §15: offsets follow their own control rule, not AdamW). Without routing state, ``inner`` as is."""

    def init(params):
        return inner.init(strip_routing_state(params))

    def update(updates, state, params=None):
        theta_params = None if params is None else strip_routing_state(params)
        theta_updates, state = inner.update(strip_routing_state(updates), state, theta_params)
        return _restore_routing_state(theta_updates, updates, jnp.zeros_like), state

    return optax.GradientTransformation(init, update)


def role_lr_scales(params, *, embed: float = 1.0, head: float = 1.0, scalar: float = 1.0):
    """A tree like ``params`` of learning-rate multipliers (Python floats) by each leaf's declared group
    (``layout.ParamInfo.lr_group``): ``embed`` for the input tables (the embedding, value embeddings; a tied
    embedding is also the head and takes ``embed``), ``head`` for the untied output projection, ``scalar`` for
    norm gains, biases, gates, skip weights and Mamba's elementwise parameters, 1 for the matrices (Muon's or
    AdamW's) and for routing state (which gets no update). nanochat and modded-nanogpt train these groups at
    their own rates. A multiplier tree composes with others leaf by leaf (``optim.multiply_scales``, applied by
    ``optim.scale_per_leaf``)."""
    factor = {"embed": embed, "head": head, "scalar": scalar, "matrix": 1.0, None: 1.0}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: float(factor[declared(tuple(key_name(e) for e in path)).lr_group]), params)
