"""Builds the core objects of a run from its config, once: each section's kind, called with its fields.

The driver calls :func:`build_experiment` once per start and hands its pieces
down; no module below the run loop and the evaluation takes the whole config.
An actor receives a :class:`WorkerSpec` (the picklable sections its estimator
is built from) and builds the same estimator on its own process: a section
carries its resolved kind, so a kind of the user's (an import path, or a
callable registered in a notebook, which travels by value) builds the same
way everywhere. What a kind builds is checked against what its section
needs, and a kind that fails names itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax

from popmeta.config import (
    Config,
    ConfigError,
    EstimatorConfig,
    KindSection,
    LearnedOptimizerConfig,
    OuterOptimizerConfig,
    TaskConfig,
    TruncationConfig,
)
from popmeta.core.estimators import GradientEstimator
from popmeta.core.learned_optimizers import LearnedOptimizer
from popmeta.core.lopt_truncated_step import VectorizedLOptTruncatedStep
from popmeta.core.mixture_truncated_step import MixtureTruncatedStep, apportion
from popmeta.core.tasks import ParametricImageMLPFamily, RescaledFamily, ScaleRange, TaskFamily
from popmeta.core.truncation import TruncationSchedule
from popmeta.registry import KindError
from popmeta.registry.outer_optimizers import outer_lr_decay

__all__ = [
    "EstimatorSections",
    "Experiment",
    "LearnerStart",
    "WorkerSpec",
    "build_estimator",
    "build_experiment",
    "build_learned_optimizer",
    "build_outer_optimizer",
    "build_task_family",
    "build_truncated_step",
    "build_truncation_schedule",
    "initial_theta",
    "learner_keys",
    "learner_start",
]


def _build(section: KindSection, *leading: Any, where: str | None = None) -> Any:
    """Calls the section's kind with ``leading`` and its fields; checks what it returned.

    Args:
      section: the section.
      *leading: what the kind takes before its fields (an estimator: the
        truncated step and the schedule).
      where: the section's dotted path, for messages (default: its own name).
    """
    registry = section.REGISTRY
    where = where or registry.section
    problems = list(section._problems())
    if problems:
        raise ConfigError("; ".join(f"{where}.{field}: {message}" for field, message in problems))
    kind = section.resolved
    assert kind is not None  # a section without problems has its kind
    try:
        built = kind.build(*leading, **section.options)
    except (ConfigError, KindError):
        raise
    except (TypeError, ValueError, OSError) as err:
        # An error about one field's value (a data file) is that field's.
        named = [
            name
            for name, value in section.options.items()
            if isinstance(value, str) and value and value in str(err)
        ]
        if len(named) == 1:
            raise ConfigError(f"{where}.{named[0]}: {err}") from err
        raise ConfigError(
            f"{where}.kind: {kind.name!r} could not be built with {dict(section.options)}: "
            f"{type(err).__name__}: {err}"
        ) from err
    try:
        return registry.check_built(kind, built)
    except KindError as err:
        raise ConfigError(f"{where}.kind: {str(err).split(': ', 1)[-1]}") from None


class EstimatorSections(NamedTuple):
    """The sections an estimator is built from, and the run's seed: all a worker is built from.

    Picklable, and every section carries its resolved kind, so an actor
    builds from it the estimator the driver built.
    """

    task: TaskConfig
    learned_optimizer: LearnedOptimizerConfig
    truncation: TruncationConfig
    estimator: EstimatorConfig
    seed: int

    @classmethod
    def of(cls, config: Config) -> EstimatorSections:
        return cls(
            config.task, config.learned_optimizer, config.truncation, config.estimator, config.seed
        )


class WorkerSpec(NamedTuple):
    """What an actor receives to build its estimator worker.

    Attributes:
      sections: what the estimator is built from (the seed fixes the worker's keys).
      shard_tasks: whether the worker spreads its tasks over its local devices.
      theta: theta's structure, shapes and dtypes (``jax.ShapeDtypeStruct``
        leaves), for the worker's state template and its warm-up.
    """

    sections: EstimatorSections
    shard_tasks: bool
    theta: Any

    @classmethod
    def of(cls, config: Config, theta: Any = None) -> WorkerSpec:
        """The spec of ``config``'s workers.

        Args:
          config: the run's config.
          theta: the initial theta, if at hand; else only its template is
            traced (nothing is computed).
        """
        sections = EstimatorSections.of(config)
        template = jax.eval_shape(lambda: initial_theta(sections) if theta is None else theta)
        return cls(sections, config.population.shard_tasks, template)

    def with_truncations_per_call(self, num_truncations: int) -> WorkerSpec:
        """The same spec with ``estimator.truncations_per_call`` set (``auto`` resolved)."""
        estimator = dataclasses.replace(
            self.sections.estimator, truncations_per_call=num_truncations
        )
        return self._replace(sections=self.sections._replace(estimator=estimator))


class LearnerStart(NamedTuple):
    """What the learner starts from (:meth:`~popmeta.learner.learner.Learner.of`).

    Attributes:
      theta: the untrained learned optimizer's theta.
      rng: the key of the learner's ``TrainState``.
      outer_transforms: the outer optimizer's transformations (the learner
        chains gradient clipping before them).
      clip_grad_norm: the learner's gradient clipping, or None.
    """

    theta: Any
    rng: jax.Array
    outer_transforms: list[optax.GradientTransformation]
    clip_grad_norm: float | None


def learner_start(config: Config) -> LearnerStart:
    """The learner's start: theta, its key and the outer optimizer, as ``config`` says."""
    outer = config.outer_optimizer
    return LearnerStart(
        theta=initial_theta(EstimatorSections.of(config)),
        rng=learner_keys(config.seed)[1],
        outer_transforms=[
            *build_outer_optimizer(outer),
            *outer_lr_decay(
                outer.lr_decay, config.train.num_steps, outer.lr_decay_to, outer.lr_decay_start
            ),
        ],
        clip_grad_norm=outer.clip_grad_norm,
    )


class Experiment(NamedTuple):
    """A run's core objects, built once per start (:func:`build_experiment`) and handed down.

    Attributes:
      worker: what each actor builds its worker from.
      estimator: the estimator as the driver built it (the state templates
        and the memory check read it; every worker builds its own).
      learner: what the learner starts from.
    """

    worker: WorkerSpec
    estimator: GradientEstimator
    learner: LearnerStart


def build_experiment(config: Config) -> Experiment:
    """Builds every kind the config names, once, as the driver does before anything starts.

    The training families (each member of a mixture) and the families
    meta-testing runs on are built to be checked; the learned optimizer, the
    estimator on its truncated step and the outer optimizer are built and
    returned. A missing data file, or a callable of the user's that fails or
    returns the wrong type, fails here, naming the section, rather than in
    every actor.

    Raises:
      ConfigError: naming the section's dotted path.
    """
    tasks = [*config.task.training_sections(), ("task", config.task)]
    tasks += [
        (f"eval.out_of_distribution.{n}", t) for n, t in config.eval.out_of_distribution.items()
    ]
    for where, task in tasks:
        _build(task, where=where)
    start = learner_start(config)
    worker = WorkerSpec.of(config, start.theta)
    return Experiment(worker=worker, estimator=build_estimator(worker.sections), learner=start)


def build_task_family(cfg: TaskConfig) -> TaskFamily:
    return _build(cfg)


def build_learned_optimizer(cfg: LearnedOptimizerConfig) -> LearnedOptimizer:
    return _build(cfg)


def build_truncation_schedule(cfg: TruncationConfig) -> TruncationSchedule:
    return _build(cfg)


def build_outer_optimizer(cfg: OuterOptimizerConfig) -> list[optax.GradientTransformation]:
    """The outer optimizer's transformations, to chain after the learner's gradient clipping."""
    built = _build(cfg)
    return list(built) if isinstance(built, list) else [built]


def build_truncated_step(
    cfg: EstimatorSections,
) -> VectorizedLOptTruncatedStep | MixtureTruncatedStep:
    """The vectorized step of ``task``, or a mixture when ``task.mixture`` is set.

    A mixture gives each member its share of ``estimator.num_tasks`` slots
    (:func:`~popmeta.core.mixture_truncated_step.apportion`), the same split on
    every worker, so that all workers' states have one shape. A parametric
    family (alone or in a mixture) becomes ``min(its num_groups, its slots)``
    groups, architectures drawn from the run's ``seed`` (the same on every
    worker, for the same reason) that split its slots evenly. A section with
    ``rescale_*`` ranges trains on its family wrapped in
    :class:`~popmeta.core.tasks.RescaledFamily`.
    """
    lopt = build_learned_optimizer(cfg.learned_optimizer)
    schedule = build_truncation_schedule(cfg.truncation)

    def vectorized(family: TaskFamily, num_tasks: int) -> VectorizedLOptTruncatedStep:
        return VectorizedLOptTruncatedStep(
            family,
            lopt,
            schedule,
            num_tasks=num_tasks,
            random_initial_iteration_offset=cfg.estimator.random_initial_iteration_offset,
            meta_loss_split=_meta_loss_split(cfg),
            meta_loss_transform=cfg.estimator.meta_loss_transform,
        )

    members = (
        {label: (m.weight, m.task) for label, m in cfg.task.mixture.items()}
        if cfg.task.mixture
        else {cfg.task.kind: (1.0, cfg.task)}
    )
    labels = list(members)
    families = {label: build_task_family(members[label][1]) for label in labels}

    if len(labels) == 1 and not isinstance(families[labels[0]], ParametricImageMLPFamily):
        return vectorized(_training_family(families[labels[0]], cfg.task), cfg.estimator.num_tasks)
    counts = apportion([members[label][0] for label in labels], cfg.estimator.num_tasks)
    groups, group_names = [], []
    for label, count in zip(labels, counts, strict=True):
        family, section = families[label], members[label][1]
        if isinstance(family, ParametricImageMLPFamily):
            configs = family.sample_configs(cfg.seed, min(family.num_groups, count))
            sizes = apportion([1.0] * len(configs), count)
            groups += [
                vectorized(_training_family(family.family_of(c), section), n)
                for c, n in zip(configs, sizes, strict=True)
            ]
            group_names += [label] * len(configs)
        else:
            groups.append(vectorized(_training_family(family, section), count))
            group_names.append(label)
    return MixtureTruncatedStep(groups, group_names)


def _training_family(family: TaskFamily, section: TaskConfig) -> TaskFamily:
    """``family`` as training runs it: rescaled when ``section`` sets rescaling ranges."""
    if not section.rescaled:
        return family
    per_tensor = ScaleRange(*section.rescale_per_tensor)
    return RescaledFamily(family, per_tensor, ScaleRange(*section.rescale_overall))


def _meta_loss_split(cfg: EstimatorSections) -> str | None:
    """The truncated step's ``meta_loss_split``: None is its training-loss default."""
    split = cfg.estimator.meta_loss_split
    return None if split == "train" else split


def build_estimator(cfg: EstimatorSections) -> GradientEstimator:
    return _build(
        cfg.estimator, build_truncated_step(cfg), build_truncation_schedule(cfg.truncation)
    )


def learner_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """The keys of theta's initialisation and of the learner's ``TrainState`` rng."""
    key_theta, key_rng = jax.random.split(jax.random.key(seed))
    return key_theta, key_rng


def initial_theta(cfg: EstimatorSections) -> Any:
    """Theta as the learner initialises it (the untrained learned optimizer)."""
    return build_learned_optimizer(cfg.learned_optimizer).init(learner_keys(cfg.seed)[0])
