"""Gradient estimators of the meta-loss with respect to theta."""

from popmeta.core.estimators.base import EstimatorOut, GradientEstimator
from popmeta.core.estimators.es import FullES, TruncatedES
from popmeta.core.estimators.nres import NoiseReuseES
from popmeta.core.estimators.pes import TruncatedPES
from popmeta.core.estimators.truncated_grad import TruncatedGrad

__all__ = [
    "EstimatorOut",
    "FullES",
    "GradientEstimator",
    "NoiseReuseES",
    "TruncatedES",
    "TruncatedGrad",
    "TruncatedPES",
]
