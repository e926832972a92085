"""Gradient estimators of the meta-loss with respect to theta, and the runners that call them."""

from popmeta.core.estimators.antithetic import AntitheticEstimator
from popmeta.core.estimators.base import FAMILY_LOSS_METRIC, GradientEstimator
from popmeta.core.estimators.es import FullES, TruncatedES
from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.core.estimators.nres import NoiseReuseES
from popmeta.core.estimators.pes import TruncatedPES
from popmeta.core.estimators.runners import (
    TASK_AXIS,
    EstimateRunner,
    ShardedRunner,
    SingleDeviceRunner,
    estimate_fn,
    make_runner,
    task_mesh,
)
from popmeta.core.estimators.truncated_grad import TruncatedGrad
from popmeta.core.estimators.truncations import truncation_keys

__all__ = [
    "FAMILY_LOSS_METRIC",
    "TASK_AXIS",
    "AntitheticEstimator",
    "EstimateRunner",
    "EstimatorOut",
    "FullES",
    "GradientEstimator",
    "NoiseReuseES",
    "ShardedRunner",
    "SingleDeviceRunner",
    "TruncatedES",
    "TruncatedGrad",
    "TruncatedPES",
    "estimate_fn",
    "make_runner",
    "task_mesh",
    "truncation_keys",
]
