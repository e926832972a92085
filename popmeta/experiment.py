"""Builds the core objects of a run from its config, through the registries.

Everything JAX is built from the (picklable) config wherever it runs: in the
driver for the local engine, inside each actor for the Ray engine. Which class
a name stands for is decided in :mod:`popmeta.registry`, not here.
"""

from __future__ import annotations

import jax

from popmeta.config import Config, LearnedOptimizerConfig, TaskConfig, TruncationConfig
from popmeta.core.estimators import GradientEstimator
from popmeta.core.learned_optimizers import LearnedOptimizer
from popmeta.core.lopt_truncated_step import VectorizedLOptTruncatedStep
from popmeta.core.mixture_truncated_step import MixtureTruncatedStep, apportion
from popmeta.core.tasks import ParametricImageMLPFamily, TaskFamily
from popmeta.core.truncation import TruncationSchedule
from popmeta.registry import ESTIMATORS, LEARNED_OPTIMIZERS, TASK_FAMILIES, TRUNCATION_SCHEDULES

__all__ = [
    "build_estimator",
    "build_learned_optimizer",
    "build_task_family",
    "build_truncated_step",
    "build_truncation_schedule",
    "initial_theta",
    "learner_keys",
]


def build_task_family(cfg: TaskConfig) -> TaskFamily:
    return TASK_FAMILIES.build(cfg.family, cfg)


def build_learned_optimizer(cfg: LearnedOptimizerConfig) -> LearnedOptimizer:
    return LEARNED_OPTIMIZERS.build(cfg.kind, cfg)


def build_truncation_schedule(cfg: TruncationConfig) -> TruncationSchedule:
    return TRUNCATION_SCHEDULES.build(cfg.schedule, cfg)


def build_truncated_step(cfg: Config) -> VectorizedLOptTruncatedStep | MixtureTruncatedStep:
    """The vectorized step of ``task.family``, or a mixture when ``task.families`` is set.

    A mixture gives each family its share of ``estimator.num_tasks`` slots
    (:func:`~popmeta.core.mixture_truncated_step.apportion`), the same split on
    every worker, so that all workers' states have one shape. A parametric
    family (alone or in a mixture) becomes ``min(task.parametric_groups, its
    slots)`` groups, architectures drawn from the run's ``seed`` (the same on
    every worker, for the same reason) that split its slots evenly.
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
        )

    weights = cfg.task.families or {cfg.task.family: 1.0}
    names = list(weights)
    families = {name: TASK_FAMILIES.build(name, cfg.task) for name in names}
    if len(names) == 1 and not isinstance(families[names[0]], ParametricImageMLPFamily):
        return vectorized(families[names[0]], cfg.estimator.num_tasks)
    counts = apportion([weights[n] for n in names], cfg.estimator.num_tasks)
    groups, group_names = [], []
    for name, count in zip(names, counts, strict=True):
        family = families[name]
        if isinstance(family, ParametricImageMLPFamily):
            configs = family.sample_configs(cfg.seed, min(cfg.task.parametric_groups, count))
            sizes = apportion([1.0] * len(configs), count)
            groups += [
                vectorized(family.family_of(c), n) for c, n in zip(configs, sizes, strict=True)
            ]
            group_names += [name] * len(configs)
        else:
            groups.append(vectorized(family, count))
            group_names.append(name)
    return MixtureTruncatedStep(groups, group_names)


def _meta_loss_split(cfg: Config) -> str | None:
    """The truncated step's ``meta_loss_split``: None is its training-loss default."""
    split = cfg.estimator.meta_loss_split
    return None if split == "train" else split


def build_estimator(cfg: Config) -> GradientEstimator:
    return ESTIMATORS.build(cfg.estimator.kind, build_truncated_step(cfg), cfg)


def learner_keys(config: Config) -> tuple[jax.Array, jax.Array]:
    """The keys of theta's initialisation and of the learner's ``TrainState`` rng."""
    key_theta, key_rng = jax.random.split(jax.random.key(config.seed))
    return key_theta, key_rng


def initial_theta(config: Config):
    """Theta as the learner initialises it (the untrained learned optimizer)."""
    return build_learned_optimizer(config.learned_optimizer).init(learner_keys(config)[0])
