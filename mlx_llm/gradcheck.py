"""Three-way gradient checks (DESIGN §5): autodiff against central differences, and an analytic gradient against
autodiff, per leaf of a parameter tree, in float64 whatever the caller's dtype, to the digits of the arithmetic the
function itself does.

``check_grads(f, params, *args, analytic=None)`` returns a ``GradReport``; ``report.assert_ok()`` raises
``AssertionError`` with the report's table (for pytest). The step of the central differences and the tolerances
come from the function's own round-off, measured at θ, so a user never picks them by hand:

* Working precision: the least precise floating type among f's result and the values on its differentiable paths
  from θ, read from the cotangents its traced backward pass computes (an integer index, a stop_gradient or a
  statistic beside the result does not count): float64, or float32 for an f that casts θ to float32, bfloat16 for
  one that casts to bfloat16. u is its machine epsilon (2⁻⁵², 2⁻²³, 2⁻⁷); the report names it. f₀ = f(θ).
* Round-off of f: ε_f = max(u·(1 + |f₀|), max_k |f(θ ⊙ (1 + ξ_k)) − f₀|), with 16 evaluations at θ moved by a few
  units in the last place (ξ_k uniform in ±4u per element, taken ±1 and ±2 times). It holds both the rounding of
  f's own arithmetic and the rounding of θ itself, which a step θ ± h·v suffers too. Relative: ε_r = ε_f/(1 + |f₀|).
* Step per leaf: h = ε_f^{1/3}·(1 + rms(θ_leaf)), the interval that balances a central difference's truncation
  and round-off (Gill, Murray & Wright 1981, *Practical Optimization* §8.6: h = ε_A^{1/3}(1 + |x|)). ``eps``
  overrides it for every leaf.
* Directional derivative along a unit vector v, to fourth order, from f_s = f(θ + s·h·v), s = ±1, ±2:
  D = [8(f₁ − f₋₁) − (f₂ − f₋₂)]/(12h). v runs over every coordinate of a leaf of at most 4·``directions``
  elements, else over ``directions`` random unit directions (seeded by ``seed`` and the leaf's index), and D is
  compared with ⟨∇f, v⟩.
* Tolerance of autodiff vs central differences, per direction: 10·ε_f/h + K, where K = max(|Δ₋|, |Δ₊|)/h is the
  larger third difference of the five points, Δ₋ = f₁ − 3f₀ + 3f₋₁ − f₋₂, Δ₊ = f₂ − 3f₁ + 3f₀ − f₋₁. D's round-off
  is at most 1.5·ε_f/h (its weights sum to 18/12). Where f is smooth on the scale h, K ≈ h²·|f‴|: six times the
  truncation error of the second-order (f₁ − f₋₁)/(2h), which bounds D's. A kink inside ±2h along v (|x| at 0, a
  ReLU, a top-k selection that changes) makes K at least twice D's miss of the derivative on either side of it,
  so the tolerance widens there: differences cannot judge a derivative across a kink (at |x|'s kink JAX's
  derivative is +1, the differences' 0).
* Tolerance of analytic vs autodiff, per element: ε_r^{2/3} · s_leaf (two thirds of the digits f carries): both
  are exact formulas evaluated in the working precision, so they agree to round-off (about ε_r), with a factor
  ε_r^{−1/3} of room for its growth through a backward pass (about 10⁵ in float64); an element wrong by one part
  in 10⁴ fails even where it is 10⁻⁵ of its leaf's largest (float64), one wrong by 10⁻³ fails in float32.
* Errors are reported relative to the leaf's scale s_leaf = max(‖∇f_leaf‖, √u·‖∇f‖_∞) (‖·‖_∞ for coordinates and
  for analytic vs autodiff, ‖·‖₂ for random directions, which bounds |⟨∇f, v⟩|; the finite elements' ‖∇f‖_∞
  floors it, so a leaf whose gradient is exactly zero is measured against the others). A NaN error fails and ranks
  first in ``worst()``.

Every bad argument raises ``InputError`` naming it, before anything is compiled: f or ``analytic`` not callable, a
bad ``seed``, ``leaves``, ``directions``, ``eps`` or ``central``, an f that returns anything but one floating
scalar, a tree with no floating element to check, or nothing to compare (``central=False`` without ``analytic``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from mlx_llm.errors import InputError

U = 2.0 ** -52  # float64's machine epsilon
AUTODIFF_VS_CENTRAL = "autodiff~central"
ANALYTIC_VS_AUTODIFF = "analytic~autodiff"
_ROWS = 16  # directions per compiled evaluation (each evaluated at 4 points)
_CPU_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_cpu_use_fusion_emitters": False}  # elemental emitters: about 20 % faster compiles here


def quick_jit(fun, **kwargs):
    """``jax.jit`` with XLA:CPU's optimisation passes off: for graphs that run once or twice (checks, tests),
    where those passes cost more compile time than they save run time. Other backends get a plain ``jax.jit``."""
    if jax.default_backend() == "cpu":
        kwargs.setdefault("compiler_options", _CPU_OPTIONS)
    return jax.jit(fun, **kwargs)


# ----- the report -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Comparison:
    """One comparison on one leaf: the largest absolute and relative error, the relative tolerance at the worst
    index (the index whose error is the largest fraction of its tolerance), that index, and whether every index
    is within its tolerance. The index is an element's index, or ``"v3"`` for random direction 3."""

    max_abs: float
    max_rel: float
    tol: float
    worst_index: tuple | str
    ok: bool
    severity: float  # the largest error / tolerance (ok ⟺ severity ≤ 1; NaN errors count as infinite)


def _rank(x: float) -> float:
    """A NaN error as the worst of all: it is no measurement, never a pass."""
    return math.inf if math.isnan(x) else x


@dataclasses.dataclass(frozen=True)
class GradReport:
    """``leaves``: leaf path ("blocks/wq", "lora/blocks/wv/A") → {comparison name → ``Comparison``}; the value
    f(θ), its measured round-off ε_f, the step h of each leaf, and the working precision checked to (the least
    precise floating type f computes in from θ: "float64", "float32", "bfloat16")."""

    leaves: dict
    value: float
    noise: float
    steps: dict
    precision: str = "float64"

    @property
    def ok(self) -> bool:
        return all(c.ok for comps in self.leaves.values() for c in comps.values())

    def worst(self) -> tuple[str, str, float]:
        """(path, comparison, relative error) of the comparison that is the largest fraction of its tolerance; a
        comparison with a NaN error ranks first."""
        path, name, comp = max(((p, n, c) for p, comps in self.leaves.items() for n, c in comps.items()),
                               key=lambda item: (math.isnan(item[2].max_rel), _rank(item[2].severity)))
        return path, name, comp.max_rel

    def __str__(self) -> str:
        width = max([len(p) for p in self.leaves] + [4])
        lines = [f"f = {self.value:.12g}, round-off ε_f = {self.noise:.2e} ({self.precision} arithmetic): "
                 f"{'ok' if self.ok else 'FAILED'}",
                 f"{'leaf':<{width}}  {'comparison':<17}  {'max abs':>9}  {'max rel':>9}  {'tol rel':>9}  "
                 f"{'worst':<12}  ok"]
        for path, comps in self.leaves.items():
            for name, c in comps.items():
                lines.append(f"{path:<{width}}  {name:<17}  {c.max_abs:9.2e}  {c.max_rel:9.2e}  {c.tol:9.2e}  "
                             f"{str(c.worst_index):<12}  {'ok' if c.ok else 'FAIL'}")
        return "\n".join(lines)

    def max_rel(self, comparison: str = ANALYTIC_VS_AUTODIFF) -> float:
        """The largest relative error of ``comparison`` over the leaves (0 if no leaf has it; NaN if one is)."""
        return max([c[comparison].max_rel for c in self.leaves.values() if comparison in c] + [0.0], key=_rank)

    def assert_ok(self) -> None:
        if not self.ok:
            path, name, rel = self.worst()
            raise AssertionError(f"gradient check failed, worst {path} ({name}, relative error {rel:.2e}):\n{self}")


# ----- trees ----------------------------------------------------------------------------------------------------
def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree) -> list[str]:
    """"a/b/0/c" for every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return ["/".join(_key_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _to_float64(tree):
    """Floating arrays (and Python floats) as float64 arrays; everything else as it is. Converted on the host, so
    no conversion kernel is compiled."""
    def cast(x):
        if isinstance(x, jax.Array) and x.dtype == jnp.float64:
            return x
        if isinstance(x, (float, np.floating)) or (hasattr(x, "dtype") and _floating(x)):
            return jnp.asarray(np.asarray(x, np.float64))
        return x
    return jax.tree.map(cast, tree)


def _selected(paths, leaves, wanted) -> list[int]:
    """Indices of the leaves to check: every floating leaf, or those under the paths of ``wanted``."""
    if wanted is None:
        return [i for i, x in enumerate(leaves) if _floating(x)]
    chosen = []
    for want in ([wanted] if isinstance(wanted, str) else wanted):
        hits = [i for i, p in enumerate(paths) if p == want or p.startswith(want.rstrip("/") + "/")]
        if not hits:
            raise InputError(f"check_grads: no leaf at path {want!r}; the leaves are {paths}")
        for i in hits:
            if not _floating(leaves[i]):
                raise InputError(f"check_grads: leaf {paths[i]!r} has dtype {jnp.result_type(leaves[i])}: only "
                                 f"floating leaves have a gradient")
        chosen += [i for i in hits if i not in chosen]
    return sorted(chosen)


def _check_analytic(tree, params, paths) -> list:
    """The analytic tree's leaves, after checking its structure and shapes against ``params``."""
    got_paths = leaf_paths(tree)
    if jax.tree.structure(tree) != jax.tree.structure(params):
        extra = [p for p in got_paths if p not in paths]
        missing = [p for p in paths if p not in got_paths]
        where = (f"it has {extra[0]!r}, which params lacks" if extra else
                 f"it lacks {missing[0]!r}" if missing else "its containers differ")
        raise InputError(f"check_grads: the analytic gradient's structure differs from params': {where}")
    out = []
    for path, a, p in zip(paths, jax.tree.leaves(tree), jax.tree.leaves(params)):
        if jnp.shape(a) != jnp.shape(p):
            raise InputError(f"check_grads: the analytic gradient of {path!r} has shape {jnp.shape(a)}; the "
                             f"parameter has {jnp.shape(p)}")
        out.append(np.asarray(a, np.float64))
    return out


# ----- the check ---------------------------------------------------------------------------------------------
def _evaluator(f_flat):
    """(θ, V (R, P), h (R,)) → f at θ + h·v, θ − h·v, θ + 2h·v, θ − 2h·v for every row v of V: (R, 4)."""
    def at(theta, v, h):
        return jax.vmap(lambda s: f_flat(theta + s * h * v))(jnp.array([1.0, -1.0, 2.0, -2.0]))
    return quick_jit(jax.vmap(at, in_axes=(None, 0, 0)))


def _evaluate_rows(evaluate, theta, rows, steps) -> np.ndarray:
    """``evaluate`` over all rows, ``_ROWS`` at a time (padded with zero rows), as one (R, 4) array. A row is
    (offset, v): the direction is v placed at θ[offset:offset + len(v)], zero elsewhere (so only ``_ROWS``
    full-length directions ever exist at once)."""
    out = []
    for first in range(0, len(rows), _ROWS):
        chunk = rows[first:first + _ROWS]
        v, h = np.zeros((_ROWS, theta.size)), np.zeros(_ROWS)
        for r, (offset, local) in enumerate(chunk):
            v[r, offset:offset + local.size] = local
        h[:len(chunk)] = steps[first:first + _ROWS]
        out.append(np.asarray(evaluate(theta, jnp.asarray(v), jnp.asarray(h)), np.float64)[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0, 4))


def _directions(n: int, directions: int, rng) -> tuple[np.ndarray, bool]:
    """(rows (K, n), whether they are the coordinates): every coordinate of a small leaf, else random unit vectors."""
    if n <= 4 * directions:
        return np.eye(n), True
    v = rng.standard_normal((directions, n))
    return v / np.linalg.norm(v, axis=1, keepdims=True), False


def _comparison(err, tol, scale, index) -> Comparison:
    severity = err / np.maximum(tol, np.finfo(np.float64).tiny)
    severity = np.where(np.isnan(severity), np.inf, severity)  # a NaN error is the worst index, never a pass
    worst = int(np.argmax(severity))
    return Comparison(float(np.max(err)), float(np.max(err) / scale), float(tol.flat[worst] / scale), index(worst),
                      bool(np.all(err <= tol)), float(severity.flat[worst]))


# ----- the arguments and the function's precision ----------------------------------------------------------------
def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_arguments(f, analytic, eps, directions, seed, leaves, central) -> None:
    """Every argument of ``check_grads`` but the trees, each refused in one line that names it."""
    def bad(name, value, rule):
        raise InputError(f"check_grads: {name} = {_shown(value)} is invalid: {rule}")
    if not callable(f):
        bad("f", f, "it must be a function f(params, *args) that returns a scalar")
    if analytic is not None and not callable(analytic):
        bad("analytic", analytic, "it must be None or a function analytic(params, *args) returning a tree")
    if isinstance(directions, bool) or not isinstance(directions, (int, np.integer)) or directions < 1:
        bad("directions", directions, "it must be a positive integer")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating))
                            or not math.isfinite(eps) or eps <= 0):
        bad("eps", eps, "it must be a positive step, or None for the rule")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        bad("seed", seed, "it must be a non-negative integer")
    if not (leaves is None or isinstance(leaves, str) or (isinstance(leaves, (list, tuple)) and leaves
                                                          and all(isinstance(p, str) for p in leaves))):
        bad("leaves", leaves, "it must be None (every floating leaf), a path or a non-empty list of paths")
    if not isinstance(central, (bool, np.bool_)):
        bad("central", central, "it must be True or False")
    if not central and analytic is None:
        raise InputError("check_grads: central=False without analytic compares nothing: give an analytic gradient "
                         "or leave central=True")


def _precision_and_gradient(f_flat, theta) -> tuple[np.dtype, float, np.ndarray]:
    """(working precision, f(θ), ∇f(θ)), after refusing any result of f but one floating scalar. f and its
    ``jax.vjp`` are traced once and compiled; the precision is read from that program: the least precise floating
    type among f's result and the values its backward pass computes from the result's cotangent (the cotangents
    of every value on a differentiable path from θ to the result, each of its value's type)."""
    out = jax.eval_shape(f_flat, theta)
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise InputError(f"check_grads: f must return one scalar array; it returned a {type(out).__name__}")
    if out.shape != ():
        raise InputError(f"check_grads: f must return a scalar; it returned shape {out.shape}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise InputError(f"check_grads: f must return a floating scalar; it returned dtype {out.dtype}")

    def value_and_grad(theta, seed):
        value, pullback = jax.vjp(f_flat, theta)
        return value, pullback(seed)[0]

    seed = np.ones((), out.dtype)
    traced = quick_jit(value_and_grad).trace(theta, seed)
    kinds = _dtypes_from(traced.jaxpr.jaxpr, [False, True])[0] | {np.dtype(out.dtype)}
    value, grad = traced.lower().compile()(theta, seed)
    return max(kinds, key=lambda d: float(jnp.finfo(d).eps)), float(value), np.asarray(grad, np.float64)


def _inner_jaxprs(params) -> list:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
                found.append(getattr(item, "jaxpr", item))
    return found


def _dtypes_from(jaxpr, live) -> tuple[set, list]:
    """(the floating dtypes of the values ``jaxpr`` computes from its inputs that ``live`` flags, which of its
    outputs depend on them): into a call's or a scan's body input for input (a scan's carry from its initial
    value or, to a fixed point, from the body), into any other body (a while loop's, a branch's) from all of its
    inputs."""
    dependent, found = {v for v, on in zip(jaxpr.invars, live) if on}, set()
    for eqn in jaxpr.eqns:
        flags = [isinstance(v, jax_core.Var) and v in dependent for v in eqn.invars]
        if not any(flags):
            continue
        if eqn.primitive.name == "scan":
            flags = _carried(eqn, flags)
        for inner in _inner_jaxprs(eqn.params):
            found |= _dtypes_from(inner, flags if len(inner.invars) == len(flags) else [True] * len(inner.invars))[0]
        dependent.update(eqn.outvars)
        found.update(v.aval.dtype for v in eqn.outvars
                     if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating))
    return found, [isinstance(v, jax_core.Var) and v in dependent for v in jaxpr.outvars]


def _carried(eqn, flags) -> list:
    """A scan's input flags with each carry flagged if the body makes it depend on the flagged inputs."""
    body, first, count = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], eqn.params["num_carry"]
    while True:
        out = _dtypes_from(body, flags)[1][:count]
        carry = [a or b for a, b in zip(flags[first:first + count], out)]
        if carry == flags[first:first + count]:
            return flags
        flags = flags[:first] + carry + flags[first + count:]


# ----- the check ---------------------------------------------------------------------------------------------
def check_grads(f, params, *args, analytic=None, eps=None, directions: int = 8, seed: int = 0,
                leaves=None, central: bool = True) -> GradReport:
    """Check the gradient of the scalar ``f(params, *args)`` with respect to every floating leaf of ``params``
    (or the leaves under the paths ``leaves`` names): autodiff against central differences and, when
    ``analytic(params, *args)`` is given (a tree like ``params``), analytic against autodiff. Everything runs in
    float64 (floating leaves of ``params`` and ``args`` are cast; the caller's x64 setting is restored after), to
    the digits of the least precise type f computes in from them; steps and tolerances follow the module
    docstring's rule. Raises ``InputError`` for every bad argument (the module docstring lists them), an analytic
    tree whose structure or shapes differ from ``params``, or an integer leaf named in ``leaves``.
    ``central=False`` leaves out the central differences: for a surrogate loss whose gradient is by design not the
    derivative of its value (a REINFORCE loss, anything through ``stop_gradient``)."""
    _check_arguments(f, analytic, eps, directions, seed, leaves, central)
    with jax.enable_x64(True):
        return _check(f, _to_float64(params), _to_float64(args), analytic, eps, int(directions), int(seed), leaves,
                      bool(central))


def _nothing_to_check(paths, flat, wanted) -> InputError:
    kinds = [f"{p}: {jnp.result_type(x)}{list(np.shape(x))}" for p, x in zip(paths, flat)]
    where = "params" if wanted is None else f"the leaves under {_shown(wanted)}"
    return InputError(f"check_grads: {where} hold no floating element to check (its leaves: "
                      f"{_shown(kinds) if kinds else 'none'})")


def _check(f, params, args, analytic, eps, directions, seed, wanted, central) -> GradReport:
    paths, flat = leaf_paths(params), jax.tree.leaves(params)
    treedef = jax.tree.structure(params)
    chosen = [i for i in _selected(paths, flat, wanted) if np.size(flat[i])]  # an empty leaf has nothing to check
    if not chosen:
        raise _nothing_to_check(paths, flat, wanted)
    sizes = [int(np.size(flat[i])) for i in chosen]
    offsets = np.cumsum([0] + sizes)
    # θ is assembled in NumPy: an eager jnp op would compile a kernel of its own
    theta = np.concatenate([np.asarray(flat[i], np.float64).ravel() for i in chosen])

    def f_flat(theta):
        new = list(flat)
        for i, start, n in zip(chosen, offsets, sizes):
            new[i] = theta[start:start + n].reshape(jnp.shape(flat[i]))
        return f(jax.tree.unflatten(treedef, new), *args)

    precision, value, grad = _precision_and_gradient(f_flat, theta)
    u = float(jnp.finfo(precision).eps)
    want = None if analytic is None else _check_analytic(analytic(params, *args), params, paths)
    theta0 = jnp.asarray(theta)
    evaluate = _evaluator(f_flat)
    rng = np.random.default_rng(seed)
    xi = rng.uniform(-4 * u, 4 * u, (4, theta.size)) * theta
    perturbed = _evaluate_rows(evaluate, theta0, [(0, row) for row in xi], np.ones(len(xi)))
    noise = max(u * (1 + abs(value)), float(np.max(np.abs(perturbed - value))))
    finite = np.abs(grad[np.isfinite(grad)])  # an infinite element fails where it is, not every leaf's scale
    floor = max(math.sqrt(u) * float(np.max(finite, initial=0.0)), np.finfo(np.float64).tiny)

    rows, steps, owners, local = [], [], [], {}
    for j, (start, n) in enumerate(zip(offsets, sizes)):
        local[j] = (_directions(n, directions, np.random.default_rng([seed, j])) if central
                    else (np.zeros((0, n)), True))
        h = eps if eps is not None else noise ** (1 / 3) * (1 + float(np.sqrt(np.mean(theta[start:start + n] ** 2))))
        rows += [(start, v) for v in local[j][0]]
        steps += [h] * len(local[j][0])
        owners += [j] * len(local[j][0])
    values = _evaluate_rows(evaluate, theta0, rows, np.asarray(steps))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # a NaN or an infinity fails, quietly
        report = _report(paths, chosen, offsets, sizes, flat, grad, want, values, local, steps, owners, value,
                         noise, floor)
    return dataclasses.replace(report, precision=np.dtype(precision).name)


def _central(values, f0, steps) -> tuple[np.ndarray, np.ndarray]:
    """Per row of f at θ + s·h·v, s = 1, −1, 2, −2: the fourth-order difference D and the smoothness term K (the
    larger third difference over h), as the module docstring defines them."""
    f1, fm1, f2, fm2 = values.T
    d4 = (8 * (f1 - fm1) - (f2 - fm2)) / (12 * steps)
    kink = np.maximum(np.abs(f1 - 3 * f0 + 3 * fm1 - fm2), np.abs(f2 - 3 * f1 + 3 * f0 - fm1)) / steps
    return d4, kink


def _report(paths, chosen, offsets, sizes, flat, grad, want, values, local, steps, owners, value, noise,
            floor) -> GradReport:
    steps, owners = np.asarray(steps), np.asarray(owners)
    d4, kink = _central(values, value, steps)
    eps_r = noise / (1 + abs(value))
    report, step_of = {}, {}
    for j, (i, start, n) in enumerate(zip(chosen, offsets, sizes)):
        g = grad[start:start + n]
        shape = np.shape(flat[i])
        at = owners == j
        vectors, coords = local[j]
        comps = {}
        if at.any():
            err, tol = np.abs(d4[at] - vectors @ g), 10 * noise / steps[at] + kink[at]
            scale = max(float(np.max(np.abs(g), initial=0.0)) if coords else float(np.linalg.norm(g)), floor)
            index = (lambda k: tuple(int(a) for a in np.unravel_index(k, shape))) if coords else (lambda k: f"v{k}")
            comps[AUTODIFF_VS_CENTRAL] = _comparison(err, tol, scale, index)
        if want is not None:
            a = want[i].reshape(-1)
            scale = max(float(np.max(np.abs(g), initial=0.0)), floor)
            comps[ANALYTIC_VS_AUTODIFF] = _comparison(np.abs(a - g), np.full(n, eps_r ** (2 / 3) * scale), scale,
                                                      lambda k: tuple(int(x) for x in np.unravel_index(k, shape)))
        report[paths[i]] = comps
        step_of[paths[i]] = float(steps[at][0]) if at.any() else 0.0
    return GradReport(report, value, noise, step_of)


# ----- plain comparisons (tests) --------------------------------------------------------------------------------
def assert_close(got, want, rel: float = 1e-10, what: str = "") -> None:
    """Norm-relative check of one array: max|got − want| ≤ rel · max(1, max|want|)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, scale = np.max(np.abs(got - want), initial=0.0), max(1.0, np.max(np.abs(want), initial=0.0))
    assert err <= rel * scale, f"{what}: max|diff| = {err:.3e}, scale = {scale:.3e}"


def assert_trees_close(got, want, rel: float = 1e-10) -> None:
    """``assert_close`` leaf by leaf, for trees of the same structure (the path names a failing leaf)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (jax.tree.structure(got), jax.tree.structure(want))
    for path, g, w in zip(leaf_paths(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, rel, path)
