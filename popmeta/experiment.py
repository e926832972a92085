"""Builds the core objects of a run from its config.

Everything JAX is built from the (picklable) config wherever it runs: in the
driver for the local engine, inside each actor for the Ray engine.
"""

from __future__ import annotations

import jax

from popmeta.config import (
    Config,
    EstimatorConfig,
    LearnedOptimizerConfig,
    TaskConfig,
    TruncationConfig,
)
from popmeta.core.estimators import (
    FullES,
    GradientEstimator,
    NoiseReuseES,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
)
from popmeta.core.learned_optimizers import (
    LearnableAdam,
    LearnableSGD,
    LearnableSGDM,
    LearnedOptimizer,
    MLPLOpt,
)
from popmeta.core.lopt_truncated_step import VectorizedLOptTruncatedStep
from popmeta.core.tasks import (
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Npz8_Relu32,
    QuadraticTask,
    TaskFamily,
    single_task_to_family,
)
from popmeta.core.truncation import (
    ConstantTruncationSchedule,
    LogUniformLengthSchedule,
    NeverEndingTruncationSchedule,
    TruncationSchedule,
)

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
    match cfg.family:
        case "quadratic":
            return single_task_to_family(QuadraticTask(cfg.dim))
        case "fixed_dim_quadratic":
            return FixedDimQuadraticFamily(cfg.dim)
        case "fixed_dim_quadratic_data":
            return FixedDimQuadraticFamilyData(cfg.dim)
        case "image_mlp_digits":
            return single_task_to_family(ImageMLP_Digits8_Relu32())
        case "image_mlp_npz":
            return single_task_to_family(ImageMLP_Npz8_Relu32(cfg.npz_path))
    raise ValueError(f"task.family: unknown family {cfg.family!r}")


def build_learned_optimizer(cfg: LearnedOptimizerConfig) -> LearnedOptimizer:
    match cfg.kind:
        case "learnable_sgd":
            return LearnableSGD(initial_lr=cfg.initial_lr)
        case "learnable_sgdm":
            return LearnableSGDM(initial_lr=cfg.initial_lr, initial_momentum=cfg.initial_momentum)
        case "learnable_adam":
            return LearnableAdam(initial_lr=cfg.initial_lr, initial_beta1=cfg.initial_momentum)
        case "mlp":
            return MLPLOpt(
                step_multiplier=cfg.step_multiplier,
                magnitude_multiplier=cfg.magnitude_multiplier,
                hidden_size=cfg.hidden_size,
            )
    raise ValueError(f"learned_optimizer.kind: unknown kind {cfg.kind!r}")


def build_truncation_schedule(cfg: TruncationConfig) -> TruncationSchedule:
    match cfg.schedule:
        case "constant":
            return ConstantTruncationSchedule(cfg.length)
        case "log_uniform":
            return LogUniformLengthSchedule(cfg.min_length, cfg.max_length)
        case "never_ending":
            return NeverEndingTruncationSchedule()
    raise ValueError(f"truncation.schedule: unknown schedule {cfg.schedule!r}")


def build_truncated_step(cfg: Config) -> VectorizedLOptTruncatedStep:
    return VectorizedLOptTruncatedStep(
        build_task_family(cfg.task),
        build_learned_optimizer(cfg.learned_optimizer),
        build_truncation_schedule(cfg.truncation),
        num_tasks=cfg.estimator.num_tasks,
        random_initial_iteration_offset=cfg.estimator.random_initial_iteration_offset,
    )


def build_estimator(cfg: Config) -> GradientEstimator:
    step = build_truncated_step(cfg)
    est: EstimatorConfig = cfg.estimator
    options = {
        "std": est.std,
        "sign_delta_loss_scalar": est.sign_delta_loss_scalar,
        "clip_loss_diff": est.clip_loss_diff,
    }
    match est.kind:
        case "pes":
            return TruncatedPES(step, est.trunc_length, **options)
        case "nres":
            return NoiseReuseES(step, est.trunc_length, **options)
        case "truncated_es":
            return TruncatedES(step, est.trunc_length, **options)
        case "full_es":
            if cfg.truncation.schedule != "constant":
                raise ValueError(
                    "estimator.kind: full_es needs truncation.schedule: constant "
                    f"(got {cfg.truncation.schedule!r})"
                )
            return FullES(step, cfg.truncation.length, **options)
        case "truncated_grad":
            return TruncatedGrad(step, est.trunc_length)
    raise ValueError(f"estimator.kind: unknown kind {est.kind!r}")


def learner_keys(config: Config) -> tuple[jax.Array, jax.Array]:
    """The keys of theta's initialisation and of the learner's ``TrainState`` rng."""
    key_theta, key_rng = jax.random.split(jax.random.key(config.seed))
    return key_theta, key_rng


def initial_theta(config: Config):
    """Theta as the learner initialises it (the untrained learned optimizer)."""
    return build_learned_optimizer(config.learned_optimizer).init(learner_keys(config)[0])
