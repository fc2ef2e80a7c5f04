"""The grid of a scaling sweep: ``SweepSpec`` (validated whole at construction: a spec that exists can be swept)
and its points (``points``), each an ordinary pretraining run; ``runs.sweep`` trains them.

A spec is a base model and a ladder of sizes (``sizes``: ModelConfig fields each size overrides), the compute
budgets (``budgets`` in exact training FLOPs, or ``tokens_per_param`` ratios), which sizes each budget trains
(``windows``, default all), the batch per budget, the peak learning rate per size (``lrs``, default the recipe's),
the seeds, the training recipe (a ``TrainConfig``) and the data (a ``DataSpec``). A point's steps are the library's
sizing (``accounting.steps_for_flops`` / ``steps_for_tokens_per_param``), so it means the same on every machine;
its warmup is min(recipe's warmup, max(2, steps // 10), steps); it evaluates and checkpoints at its end (and every
``checkpoint_interval`` steps when the recipe's is shorter).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping

from mlx_llm.config import INT32_MAX, PARAM_COUNTS, SEED_MAX, ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.scaling.accounting import steps_for_flops, steps_for_tokens_per_param, train_flops_per_token


def _tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _positive(v) -> bool:
    """A finite number > 0 (not a bool): a budget, a ratio, a learning rate."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _int_in(v, low: int, high: int) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and low <= v <= high


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """The grid of a scaling sweep (module docstring): ``model`` (the base; its ``vocab_size`` becomes the
    tokenizer's), ``sizes`` (ModelConfig fields per size, smallest model first; empty: the base alone), exactly one
    of ``budgets`` (exact training FLOPs) and ``tokens_per_param`` (with ``param_count``), ``windows`` (per budget,
    the indices of the sizes it trains; None: all), ``batch_sizes`` (per budget; None: the recipe's), ``lrs`` (per
    size; None: the recipe's), ``seeds`` (distinct, in [0, 2**63 - 1]), ``train`` (the recipe) and ``data``. Every
    field is checked here: an invalid one raises ``ConfigError`` naming it, the value and what is valid."""

    model: ModelConfig
    sizes: tuple[dict, ...] = ()
    budgets: tuple[float, ...] = ()
    tokens_per_param: tuple[float, ...] = ()
    param_count: str = "total"
    windows: tuple[tuple[int, ...], ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    lrs: tuple[float, ...] | None = None
    seeds: tuple[int, ...] = (0,)
    train: TrainConfig = TrainConfig()
    data: DataSpec = DataSpec()

    def __post_init__(self) -> None:
        self._normalize()
        for name, cls in (("model", ModelConfig), ("train", TrainConfig), ("data", DataSpec)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"SweepSpec.{name} must be a {cls.__name__}; got {type(getattr(self, name)).__name__}")
        if bool(self.budgets) == bool(self.tokens_per_param):
            raise ConfigError("SweepSpec: give exactly one of budgets (training FLOPs) and tokens_per_param; got "
                              f"budgets = {list(self.budgets)}, tokens_per_param = {list(self.tokens_per_param)}")
        for name in ("budgets", "tokens_per_param", "lrs"):
            if not all(_positive(v) for v in getattr(self, name) or ()):
                raise ConfigError(f"SweepSpec.{name} = {list(getattr(self, name))} is invalid: each must be a finite "
                                  f"number > 0")
        if self.param_count not in PARAM_COUNTS:
            raise ConfigError(f"SweepSpec.param_count = {self.param_count!r} is invalid: valid counts are "
                              f"{list(PARAM_COUNTS)}")
        self._check_lengths()
        for name, low, high in (("batch_sizes", 1, INT32_MAX), ("seeds", 0, SEED_MAX)):
            if not all(_int_in(v, low, high) for v in getattr(self, name) or ()):
                raise ConfigError(f"SweepSpec.{name} = {list(getattr(self, name))} is invalid: integers in "
                                  f"[{low}, {high}]")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"SweepSpec.seeds = {list(self.seeds)} is invalid: give distinct seeds")
        for i in range(max(1, len(self.sizes))):
            self.size_config(i)  # every size is a valid model (ModelConfig's own message names the field)

    def _normalize(self) -> None:
        """Lists become tuples (a spec read from JSON equals the one written); a size must be a mapping and
        ``windows`` a list of lists."""
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        bad = [k for k, s in enumerate(_tuple(self.sizes)) if not isinstance(s, Mapping)]
        if bad:
            raise ConfigError(f"SweepSpec.sizes[{bad[0]}] = {_tuple(self.sizes)[bad[0]]!r} is invalid: each size is "
                              f"a mapping of ModelConfig fields, e.g. {{'d_model': 64, 'n_layers': 2}}")
        fix("sizes", tuple(dict(s) for s in _tuple(self.sizes)))
        for name in ("budgets", "tokens_per_param", "seeds"):
            fix(name, _tuple(getattr(self, name)))
        for name in ("batch_sizes", "lrs"):
            if getattr(self, name) is not None:
                fix(name, _tuple(getattr(self, name)))
        if self.windows is not None:
            if not isinstance(self.windows, (list, tuple)):
                raise ConfigError(f"SweepSpec.windows = {self.windows!r} is invalid: one list of size indices per "
                                  f"budget, or None")
            fix("windows", tuple(_tuple(w) for w in self.windows))

    def _check_lengths(self) -> None:
        n_budgets, n_sizes = len(self.budget_values), max(1, len(self.sizes))
        for name, length, what in (("windows", n_budgets, "budget"), ("batch_sizes", n_budgets, "budget"),
                                   ("lrs", n_sizes, "size")):
            value = getattr(self, name)
            if value is not None and len(value) != length:
                raise ConfigError(f"SweepSpec.{name} has {len(value)} entries: give one per {what} ({length})")
        for k, window in enumerate(self.windows or ()):
            bad = [i for i in window if not _int_in(i, 0, n_sizes - 1)]
            if bad or not window or len(set(window)) != len(window):
                raise ConfigError(f"SweepSpec.windows[{k}] = {list(window)} is invalid: distinct size indices in "
                                  f"[0, {n_sizes})")

    @property
    def budget_values(self) -> tuple[float, ...]:
        return self.budgets or self.tokens_per_param

    @property
    def budget_unit(self) -> str:
        return "flops" if self.budgets else "tokens_per_param"

    def size_config(self, i: int, vocab_size: int | None = None) -> ModelConfig:
        """The model of size ``i`` (the base with its overrides), with ``vocab_size`` when given."""
        fields = dict(self.sizes[i]) if self.sizes else {}
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)}, key=str)
        if unknown:
            raise ConfigError(f"SweepSpec.sizes[{i}] sets unknown ModelConfig field(s) {unknown}")
        if vocab_size is not None:
            fields |= {"vocab_size": vocab_size, "vocab_used": None}
        return dataclasses.replace(self.model, **fields)

    def to_dict(self) -> dict:
        """The spec as JSON: what ``sweep.json`` holds and what a rerun is compared with."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out |= {"model": self.model.to_dict(), "train": self.train.to_dict(), "data": self.data.to_dict()}
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data) -> "SweepSpec":
        if not isinstance(data, dict):
            raise ConfigError(f"a sweep spec is a JSON object; got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        missing = [k for k in ("model", "train", "data") if k not in data]
        if unknown or missing:
            raise ConfigError(f"a sweep spec {'sets unknown field(s) ' + str(unknown) if unknown else ''}"
                              f"{' and ' if unknown and missing else ''}"
                              f"{'lacks ' + str(missing) if missing else ''}: valid fields are "
                              f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**{**data, "model": ModelConfig.from_dict(data["model"]), "train": TrainConfig.from_dict(
            data["train"]), "data": DataSpec.from_dict(data["data"])})


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: its name (the run directory's), budget (and its index), size index, seed, and the
    model and train configs it trains with."""

    name: str
    budget_index: int
    budget: float
    budget_unit: str
    size_index: int
    seed: int
    cfg: ModelConfig
    tcfg: TrainConfig


def _size_labels(spec: SweepSpec, vocab_size: int) -> list[str]:
    """d{d_model}-L{n_layers} per size, prefixed by the size's index when two sizes share it."""
    cfgs = [spec.size_config(i, vocab_size) for i in range(max(1, len(spec.sizes)))]
    labels = [f"d{c.d_model}-L{c.n_layers}" for c in cfgs]
    return labels if len(set(labels)) == len(labels) else [f"n{i}-{lab}" for i, lab in enumerate(labels)]


def points(spec: SweepSpec, vocab_size: int) -> list[Point]:
    """Every run of the sweep, budget by budget (sizes in window order, then seeds), with its steps from the
    library's sizing (module docstring)."""
    out = []
    labels = _size_labels(spec, vocab_size)
    prefix = "C" if spec.budgets else "R"
    rec = spec.train
    for k, budget in enumerate(spec.budget_values):
        batch = spec.batch_sizes[k] if spec.batch_sizes else rec.batch_size
        for i in (spec.windows[k] if spec.windows else range(len(labels))):
            cfg = spec.size_config(i, vocab_size)
            if spec.budgets:
                steps = steps_for_flops(cfg, rec.seq_len, batch, budget)
            else:
                steps = steps_for_tokens_per_param(cfg, rec.seq_len, batch, budget, spec.param_count)
            for seed in spec.seeds:
                tcfg = dataclasses.replace(
                    rec, batch_size=batch, steps=steps, seed=seed, lr=spec.lrs[i] if spec.lrs else rec.lr,
                    warmup_steps=min(rec.warmup_steps, max(2, steps // 10), steps), eval_interval=steps,
                    checkpoint_interval=min(rec.checkpoint_interval, steps), log_interval=min(rec.log_interval, steps))
                out.append(Point(f"{prefix}{k}-{labels[i]}-s{seed}", k, float(budget), spec.budget_unit, i, seed, cfg,
                                 tcfg))
    return out


def training_compute(cfg: ModelConfig, tcfg: TrainConfig) -> float:
    """C of a run: exact training FLOPs, ``train_flops_per_token`` × the D tokens it reads."""
    return train_flops_per_token(cfg, tcfg.seq_len) * tcfg.steps * tcfg.batch_size * tcfg.seq_len
