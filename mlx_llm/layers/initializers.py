"""Initialising the arrays of the layout (layers/layout.py declares them; this module draws them). Kept apart so
that the layout — and with it the configs' parameter counts and the CLI — imports no jax."""

from __future__ import annotations

import jax.numpy as jnp

from mlx_llm.layers.layout import ParamInfo, mup_init_mult, present, shape


HALF = {"half": lambda full, dtype, draw: jnp.full(full, 0.5, dtype)}  # a gate that starts at 1/2


def init_array(info: ParamInfo, cfg, normal, dtype, lead: tuple[int, ...] = (), rules=None):
    """One array of shape ``lead`` + its shape: its draw ``normal(shape, std)`` (if it takes one; std × μP's
    ``mup_init_mult``), then its init; zeros where ``info.zero_if(cfg)`` holds (after the draw, so the key stream
    is unchanged). ``normal`` is the main stream's, or a pair (main, extra) whose second serves the ``extra``
    arrays (the knobs' second stream). ``rules`` maps the names of non-built-in inits to
    ``rule(shape, dtype, draw)``."""
    full = (*lead, *shape(info, cfg))
    main, extra = normal if isinstance(normal, tuple) else (normal, None)
    std = info.std(cfg) * mup_init_mult(info, cfg) if info.draws or info.extra else None
    if info.extra:
        if extra is None:
            raise ValueError("this array draws from the knobs' second key stream: pass normal as (main, extra)")
        z = extra(full, std)
    else:
        z = main(full, std) if info.draws else None
    if info.zero_if is not None and info.zero_if(cfg):
        return jnp.zeros(full, dtype)
    if info.init == "normal":
        return z
    if info.init in ("ones", "zeros"):
        return (jnp.ones if info.init == "ones" else jnp.zeros)(full, dtype)
    if rules is None or info.init not in rules:
        raise ValueError(f"no rule for init {info.init!r}: pass it in ``rules``")
    return rules[info.init](full, dtype, z)


def init_table(table: dict[str, ParamInfo], cfg, normal, L: int, dtype, rules=None) -> dict:
    """Every array of one kind for L stacked layers, drawn in table order (``draws(table)`` calls of the main
    stream's ``normal``); absent arrays are drawn too (empty, for S = 0) and left out, except those of the second
    stream (``extra``), which draw only when present."""
    arrays = {k: init_array(info, cfg, normal, dtype, (L,), {**HALF, **(rules or {})}) for k, info in table.items()
              if not (info.extra and not present(info, cfg))}
    return {k: v for k, v in arrays.items() if present(table[k], cfg)}
