"""Gradient estimators of the meta-loss with respect to theta."""

from popmeta.core.estimators.antithetic import AntitheticEstimator
from popmeta.core.estimators.base import EstimatorOut, GradientEstimator, truncation_keys
from popmeta.core.estimators.es import FullES, TruncatedES
from popmeta.core.estimators.nres import NoiseReuseES
from popmeta.core.estimators.pes import TruncatedPES
from popmeta.core.estimators.sharding import TASK_AXIS, TaskSharding, task_mesh
from popmeta.core.estimators.truncated_grad import TruncatedGrad

__all__ = [
    "TASK_AXIS",
    "AntitheticEstimator",
    "EstimatorOut",
    "FullES",
    "GradientEstimator",
    "NoiseReuseES",
    "TaskSharding",
    "TruncatedES",
    "TruncatedGrad",
    "TruncatedPES",
    "task_mesh",
    "truncation_keys",
]
