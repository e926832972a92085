"""popmeta: distributed meta-training of learned optimizers with ES-family gradient estimates."""

import importlib

from popmeta.config import Config, ConfigError, load_config
from popmeta.core.estimators import (
    EstimateRunner,
    EstimatorOut,
    FullES,
    GradientEstimator,
    NoiseReuseES,
    ShardedRunner,
    SingleDeviceRunner,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
    make_runner,
)
from popmeta.core.evaluation import TrainingCurves, training_curves
from popmeta.core.learned_optimizers import (
    AdamMLPLOpt,
    LearnableAdam,
    LearnableSGD,
    LearnableSGDM,
    LearnedOptimizer,
    LearnedOptimizerState,
    MLPLOpt,
    MLPLOptState,
    as_optax,
)
from popmeta.core.lopt_truncated_step import VectorizedLOptTruncatedStep
from popmeta.core.mixture_truncated_step import MixtureTruncatedStep
from popmeta.core.optimizers import SGD, SGDM, Adam, OptaxOptimizer, OptaxState, Optimizer
from popmeta.core.tasks import (
    CurvedQuadraticFamily,
    FixedDimQuadraticFamily,
    FixedDimQuadraticFamilyData,
    ImageMLP_Digits8_Relu32,
    ImageMLP_Npz8_Relu32,
    ImageMLPTask,
    QuadraticTask,
    Task,
    TaskFamily,
    load_npz_images_8x8,
    single_task_to_family,
    vec_get_batch,
)
from popmeta.core.threefry import use_unrolled_threefry_on_cpu
from popmeta.core.truncated_step import TruncatedStep, TruncatedUnrollOut, VectorizedTruncatedStep
from popmeta.core.truncation import (
    ConstantTruncationSchedule,
    LogUniformLengthSchedule,
    NeverEndingTruncationSchedule,
    TruncationSchedule,
    TruncationState,
)
from popmeta.learner.train_state import (
    TrainState,
    build_apply_estimates_fn,
    make_outer_optimizer,
)
from popmeta.registry import (
    register_estimator,
    register_learned_optimizer,
    register_outer_optimizer,
    register_task_family,
    register_truncation_schedule,
)
from popmeta.xla_flags import use_xla_cpu_flags

#: Names of the shell's top, imported on first use: the run loop brings Ray
#: and the export the evaluation, which the library's functions do without.
_LAZY = {
    "RunResult": "popmeta.run_loop",
    "train": "popmeta.run_loop",
    "TrainedOptimizer": "popmeta.export",
    "export_optimizer": "popmeta.export",
    "load_optimizer": "popmeta.export",
    "read_trained_optimizer": "popmeta.export",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'popmeta' has no attribute {name!r}")


# Same random bits, fewer XLA operations per draw on CPU (see popmeta.core.threefry).
use_unrolled_threefry_on_cpu()
# Small inner loops as one CPU kernel, if JAX has yet to start (see popmeta.xla_flags).
use_xla_cpu_flags()

__all__ = [
    "SGD",
    "SGDM",
    "Adam",
    "AdamMLPLOpt",
    "Config",
    "ConfigError",
    "ConstantTruncationSchedule",
    "CurvedQuadraticFamily",
    "EstimateRunner",
    "EstimatorOut",
    "FixedDimQuadraticFamily",
    "FixedDimQuadraticFamilyData",
    "FullES",
    "GradientEstimator",
    "ImageMLPTask",
    "ImageMLP_Digits8_Relu32",
    "ImageMLP_Npz8_Relu32",
    "LearnableAdam",
    "LearnableSGD",
    "LearnableSGDM",
    "LearnedOptimizer",
    "LearnedOptimizerState",
    "LogUniformLengthSchedule",
    "MLPLOpt",
    "MLPLOptState",
    "MixtureTruncatedStep",
    "NeverEndingTruncationSchedule",
    "NoiseReuseES",
    "OptaxOptimizer",
    "OptaxState",
    "Optimizer",
    "QuadraticTask",
    "RunResult",
    "ShardedRunner",
    "SingleDeviceRunner",
    "Task",
    "TaskFamily",
    "TrainState",
    "TrainedOptimizer",
    "TrainingCurves",
    "TruncatedES",
    "TruncatedGrad",
    "TruncatedPES",
    "TruncatedStep",
    "TruncatedUnrollOut",
    "TruncationSchedule",
    "TruncationState",
    "VectorizedLOptTruncatedStep",
    "VectorizedTruncatedStep",
    "as_optax",
    "build_apply_estimates_fn",
    "export_optimizer",
    "load_config",
    "load_npz_images_8x8",
    "load_optimizer",
    "make_outer_optimizer",
    "make_runner",
    "read_trained_optimizer",
    "register_estimator",
    "register_learned_optimizer",
    "register_outer_optimizer",
    "register_task_family",
    "register_truncation_schedule",
    "single_task_to_family",
    "train",
    "training_curves",
    "use_unrolled_threefry_on_cpu",
    "use_xla_cpu_flags",
    "vec_get_batch",
]
