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
from popmeta.core.tasks import TaskFamily
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


def build_truncated_step(cfg: Config) -> VectorizedLOptTruncatedStep:
    return VectorizedLOptTruncatedStep(
        build_task_family(cfg.task),
        build_learned_optimizer(cfg.learned_optimizer),
        build_truncation_schedule(cfg.truncation),
        num_tasks=cfg.estimator.num_tasks,
        random_initial_iteration_offset=cfg.estimator.random_initial_iteration_offset,
    )


def build_estimator(cfg: Config) -> GradientEstimator:
    return ESTIMATORS.build(cfg.estimator.kind, build_truncated_step(cfg), cfg)


def learner_keys(config: Config) -> tuple[jax.Array, jax.Array]:
    """The keys of theta's initialisation and of the learner's ``TrainState`` rng."""
    key_theta, key_rng = jax.random.split(jax.random.key(config.seed))
    return key_theta, key_rng


def initial_theta(config: Config):
    """Theta as the learner initialises it (the untrained learned optimizer)."""
    return build_learned_optimizer(config.learned_optimizer).init(learner_keys(config)[0])
