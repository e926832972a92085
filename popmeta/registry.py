"""The kinds a config may name: one registry per kind, each name with its builder.

A config names a task family, a learned optimizer, a truncation schedule, an
estimator and an outer optimizer by a short string. Each of those strings is an
entry of one :class:`Registry` below, and everything that depends on the set
of names reads it from there:

* the config's accepted values (:mod:`popmeta.config` turns ``names`` into the
  field's ``Literal`` type, so a wrong name fails listing the right ones);
* the builder that turns a config section into a core object
  (:mod:`popmeta.experiment`);
* the documentation: ``popmeta kinds`` prints every registry and
  ``docs/kinds.md`` is its output.

Builders receive the config section (or, for estimators, the truncated step
and the whole config) and read only the fields they need; this module never
imports the config, which sits above it.

Adding a kind is one ``@REGISTRY.register(name, summary)`` on a builder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import optax

from popmeta.core.estimators import (
    FullES,
    GradientEstimator,
    NoiseReuseES,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
)
from popmeta.core.learned_optimizers import (
    AdamMLPLOpt,
    LearnableAdam,
    LearnableSGD,
    LearnableSGDM,
    LearnedOptimizer,
    MLPLOpt,
)
from popmeta.core.tasks import (
    Conv_Digits8,
    CurvedQuadraticFamily,
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits4_Relu32,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Digits16_Relu32,
    ImageMLP_Npz8_Relu32,
    ParametricImageMLP_Digits8,
    QuadraticTask,
    TaskFamily,
    single_task_to_family,
)
from popmeta.core.truncated_step import TruncatedStep
from popmeta.core.truncation import (
    ConstantTruncationSchedule,
    LogUniformLengthSchedule,
    NeverEndingTruncationSchedule,
    TruncationSchedule,
)

__all__ = [
    "DATA_FREE_TASK_FAMILIES",
    "ESTIMATORS",
    "LEARNED_OPTIMIZERS",
    "OUTER_OPTIMIZERS",
    "REGISTRIES",
    "TASK_FAMILIES",
    "TRUNCATION_SCHEDULES",
    "Entry",
    "Registry",
    "render_markdown",
]

T = TypeVar("T")


class Entry(NamedTuple, Generic[T]):
    """One name a config may use.

    Attributes:
      name: the string a config writes.
      summary: one line for ``popmeta kinds`` and the docs.
      build: the builder; its arguments depend on the registry.
    """

    name: str
    summary: str
    build: Callable[..., T]


class Registry(Generic[T]):
    """Names of one kind, in registration order, each with its builder.

    Args:
      field: the dotted config field that names an entry (``estimator.kind``).
      title: what the entries are, for docs and messages.
      builds: what a builder takes and returns, for the docs.
    """

    def __init__(self, field: str, title: str, builds: str):
        self.field = field
        self.title = title
        self.builds = builds
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, summary: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator that adds ``name`` with the decorated builder."""

        def add(build: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise ValueError(f"{self.field}: {name!r} is registered twice")
            self._entries[name] = Entry(name, summary, build)
            return build

        return add

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            choices = ", ".join(repr(n) for n in self._entries)
            raise ValueError(f"{self.field}: expected one of {choices}, got {name!r}") from None

    def build(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Builds entry ``name``; an unknown name fails naming the field and the choices."""
        return self[name].build(*args, **kwargs)


# -- task families: build(task_config) -> TaskFamily ------------------------------------

TASK_FAMILIES: Registry[TaskFamily] = Registry(
    "task.family", "Task families", "the `task` section -> a `TaskFamily`"
)


#: Task families without data: they have no ``outer_valid`` split to take a meta-loss on.
DATA_FREE_TASK_FAMILIES: frozenset[str] = frozenset(
    {"quadratic", "fixed_dim_quadratic", "curved_quadratic"}
)


@TASK_FAMILIES.register("quadratic", "`sum(p**2)` in `task.dim` dimensions from a random start")
def _quadratic(cfg: Any) -> TaskFamily:
    return single_task_to_family(QuadraticTask(cfg.dim))


@TASK_FAMILIES.register(
    "fixed_dim_quadratic",
    "`sum((t - p)**2)` in `task.dim` dimensions, target `t ~ N(0, I)` sampled per task",
)
def _fixed_dim_quadratic(cfg: Any) -> TaskFamily:
    return FixedDimQuadraticFamily(cfg.dim)


@TASK_FAMILIES.register(
    "curved_quadratic",
    "popmeta's own: `0.5 * sum(s * (p - t)**2)`, target `t ~ N(0, I)` and per-coordinate "
    "curvature `s ~ LogUniform(0.1, 10)` sampled per task (the quickstart's family)",
)
def _curved_quadratic(cfg: Any) -> TaskFamily:
    return CurvedQuadraticFamily(cfg.dim)


@TASK_FAMILIES.register(
    "fixed_dim_quadratic_data",
    "`fixed_dim_quadratic` plus scalar `N(0, 1)` noise data; meta-loss clipped to [0, 1000]",
)
def _fixed_dim_quadratic_data(cfg: Any) -> TaskFamily:
    return FixedDimQuadraticFamilyData(cfg.dim)


@TASK_FAMILIES.register(
    "image_mlp_digits", "a 64-32-10 ReLU MLP on scikit-learn's bundled 8x8 digits"
)
def _image_mlp_digits(cfg: Any) -> TaskFamily:
    del cfg
    return single_task_to_family(ImageMLP_Digits8_Relu32())


@TASK_FAMILIES.register(
    "image_mlp_digits4", "a 16-32-10 ReLU MLP on the bundled digits shrunk to 4x4 (2x2 means)"
)
def _image_mlp_digits4(cfg: Any) -> TaskFamily:
    del cfg
    return single_task_to_family(ImageMLP_Digits4_Relu32())


@TASK_FAMILIES.register(
    "image_mlp_digits16", "a 256-32-10 ReLU MLP on the bundled digits enlarged to 16x16"
)
def _image_mlp_digits16(cfg: Any) -> TaskFamily:
    del cfg
    return single_task_to_family(ImageMLP_Digits16_Relu32())


@TASK_FAMILIES.register(
    "conv_digits", "two 3x3 ReLU convolutions (8 channels) and a dense layer on the 8x8 digits"
)
def _conv_digits(cfg: Any) -> TaskFamily:
    del cfg
    return single_task_to_family(Conv_Digits8())


@TASK_FAMILIES.register(
    "parametric_image_mlp_digits",
    "MLPs on the 8x8 digits with sampled width, depth, activation and batch size: "
    "`task.parametric_groups` architectures drawn from the run's seed, one task group each",
)
def _parametric_image_mlp_digits(cfg: Any) -> TaskFamily:
    del cfg
    return ParametricImageMLP_Digits8()


@TASK_FAMILIES.register(
    "image_mlp_npz", "a 64-32-10 ReLU MLP on 8x8 images from the `.npz` file `task.npz_path`"
)
def _image_mlp_npz(cfg: Any) -> TaskFamily:
    return single_task_to_family(ImageMLP_Npz8_Relu32(cfg.npz_path))


# -- learned optimizers: build(learned_optimizer_config) -> LearnedOptimizer -------------

LEARNED_OPTIMIZERS: Registry[LearnedOptimizer] = Registry(
    "learned_optimizer.kind",
    "Learned optimizers",
    "the `learned_optimizer` section -> a `LearnedOptimizer`",
)


@LEARNED_OPTIMIZERS.register("learnable_sgd", "SGD with a learned learning rate")
def _learnable_sgd(cfg: Any) -> LearnedOptimizer:
    return LearnableSGD(initial_lr=cfg.initial_lr)


@LEARNED_OPTIMIZERS.register("learnable_sgdm", "SGD with learned learning rate and momentum")
def _learnable_sgdm(cfg: Any) -> LearnedOptimizer:
    return LearnableSGDM(initial_lr=cfg.initial_lr, initial_momentum=cfg.initial_momentum)


@LEARNED_OPTIMIZERS.register("learnable_adam", "Adam with learned learning rate, betas and epsilon")
def _learnable_adam(cfg: Any) -> LearnedOptimizer:
    return LearnableAdam(initial_lr=cfg.initial_lr, initial_beta1=cfg.initial_momentum)


@LEARNED_OPTIMIZERS.register("mlp", "a per-parameter MLP over gradient and momentum features")
def _mlp(cfg: Any) -> LearnedOptimizer:
    return MLPLOpt(
        step_multiplier=cfg.step_multiplier,
        magnitude_multiplier=cfg.magnitude_multiplier,
        hidden_size=cfg.hidden_size,
    )


@LEARNED_OPTIMIZERS.register(
    "mlp_adam",
    "Adam (learning rate `initial_lr`) rescaled and corrected per parameter by an MLP that "
    "reads the MLP features and the fraction of the run done; starts as Adam",
)
def _mlp_adam(cfg: Any) -> LearnedOptimizer:
    return AdamMLPLOpt(initial_lr=cfg.initial_lr, hidden_size=cfg.hidden_size)


# -- truncation schedules: build(truncation_config) -> TruncationSchedule ----------------

TRUNCATION_SCHEDULES: Registry[TruncationSchedule] = Registry(
    "truncation.schedule",
    "Truncation schedules",
    "the `truncation` section -> a `TruncationSchedule`",
)


@TRUNCATION_SCHEDULES.register("constant", "every trajectory runs `truncation.length` steps")
def _constant(cfg: Any) -> TruncationSchedule:
    return ConstantTruncationSchedule(cfg.length)


@TRUNCATION_SCHEDULES.register(
    "log_uniform",
    "each trajectory's length is drawn log-uniformly in [`min_length`, `max_length`]",
)
def _log_uniform(cfg: Any) -> TruncationSchedule:
    return LogUniformLengthSchedule(cfg.min_length, cfg.max_length)


@TRUNCATION_SCHEDULES.register("never_ending", "trajectories never reset")
def _never_ending(cfg: Any) -> TruncationSchedule:
    del cfg
    return NeverEndingTruncationSchedule()


# -- estimators: build(truncated_step, config) -> GradientEstimator ----------------------

ESTIMATORS: Registry[GradientEstimator] = Registry(
    "estimator.kind",
    "Gradient estimators",
    "the truncated step and the whole config -> a `GradientEstimator`",
)


def _antithetic_options(cfg: Any) -> dict[str, Any]:
    est = cfg.estimator
    return {
        "std": est.std,
        "sign_delta_loss_scalar": est.sign_delta_loss_scalar,
        "clip_loss_diff": est.clip_loss_diff,
    }


@ESTIMATORS.register("pes", "Persistent ES: unbiased, persistent antithetic states")
def _pes(step: TruncatedStep, cfg: Any) -> GradientEstimator:
    return TruncatedPES(step, cfg.estimator.trunc_length, **_antithetic_options(cfg))


@ESTIMATORS.register("nres", "Noise-reuse ES: PES's mean with lower variance")
def _nres(step: TruncatedStep, cfg: Any) -> GradientEstimator:
    return NoiseReuseES(step, cfg.estimator.trunc_length, **_antithetic_options(cfg))


@ESTIMATORS.register("full_es", "antithetic ES over whole episodes of `truncation.length` steps")
def _full_es(step: TruncatedStep, cfg: Any) -> GradientEstimator:
    return FullES(step, cfg.truncation.length, **_antithetic_options(cfg))


@ESTIMATORS.register("truncated_es", "antithetic ES per truncation (biased)")
def _truncated_es(step: TruncatedStep, cfg: Any) -> GradientEstimator:
    return TruncatedES(step, cfg.estimator.trunc_length, **_antithetic_options(cfg))


@ESTIMATORS.register("truncated_grad", "truncated backpropagation through the unroll (biased)")
def _truncated_grad(step: TruncatedStep, cfg: Any) -> GradientEstimator:
    return TruncatedGrad(step, cfg.estimator.trunc_length)


# -- outer optimizers: build(learning_rate, weight_decay, ...) -> [transforms] ----------

OUTER_OPTIMIZERS: Registry[list[optax.GradientTransformation]] = Registry(
    "outer_optimizer.name",
    "Outer optimizers",
    "learning rate, weight decay, momentum and Adam's b1, b2, eps -> the optax "
    "transformations after gradient clipping",
)


def _l2(weight_decay: float) -> list[optax.GradientTransformation]:
    # Coupled L2: `wd * params` joins the (clipped) gradient before the optimizer.
    return [optax.add_decayed_weights(weight_decay)] if weight_decay > 0 else []


@OUTER_OPTIMIZERS.register("adam", "Adam, with coupled L2 weight decay")
def _adam(learning_rate, weight_decay, *, momentum, b1, b2, eps):
    del momentum
    return [*_l2(weight_decay), optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)]


@OUTER_OPTIMIZERS.register("adamw", "Adam with decoupled weight decay")
def _adamw(learning_rate, weight_decay, *, momentum, b1, b2, eps):
    del momentum
    return [optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)]


@OUTER_OPTIMIZERS.register("sgd", "plain SGD, with coupled L2 weight decay")
def _sgd(learning_rate, weight_decay, *, momentum, b1, b2, eps):
    del momentum, b1, b2, eps
    return [*_l2(weight_decay), optax.sgd(learning_rate)]


@OUTER_OPTIMIZERS.register("sgdm", "SGD with momentum, with coupled L2 weight decay")
def _sgdm(learning_rate, weight_decay, *, momentum, b1, b2, eps):
    del b1, b2, eps
    return [*_l2(weight_decay), optax.sgd(learning_rate, momentum=momentum)]


#: Every registry, in the order of the config's sections.
REGISTRIES: tuple[Registry[Any], ...] = (
    TASK_FAMILIES,
    LEARNED_OPTIMIZERS,
    TRUNCATION_SCHEDULES,
    ESTIMATORS,
    OUTER_OPTIMIZERS,
)


def render_markdown() -> str:
    """Every registry as Markdown: what ``popmeta kinds`` prints and ``docs/kinds.md`` holds."""
    lines = [
        "# Kinds a config can name",
        "",
        "Generated from `popmeta/registry.py` by `popmeta kinds`; a test keeps this page",
        "equal to its output.",
    ]
    for registry in REGISTRIES:
        lines += [
            "",
            f"## {registry.title}: `{registry.field}`",
            "",
            f"Builder: {registry.builds}.",
            "",
            "| name | what it is |",
            "|---|---|",
        ]
        lines += [f"| `{entry.name}` | {entry.summary} |" for entry in registry]
    return "\n".join(lines) + "\n"
