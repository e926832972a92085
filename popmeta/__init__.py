"""popmeta: distributed meta-training of learned optimizers with ES-family gradient estimates."""

from popmeta.core.estimators import (
    EstimatorOut,
    FullES,
    GradientEstimator,
    NoiseReuseES,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
)
from popmeta.core.truncated_step import TruncatedStep, TruncatedUnrollOut, VectorizedTruncatedStep
from popmeta.core.truncation import (
    ConstantTruncationSchedule,
    LogUniformLengthSchedule,
    NeverEndingTruncationSchedule,
    TruncationSchedule,
    TruncationState,
)

__all__ = [
    "ConstantTruncationSchedule",
    "EstimatorOut",
    "FullES",
    "GradientEstimator",
    "LogUniformLengthSchedule",
    "NeverEndingTruncationSchedule",
    "NoiseReuseES",
    "TruncatedES",
    "TruncatedGrad",
    "TruncatedPES",
    "TruncatedStep",
    "TruncatedUnrollOut",
    "TruncationSchedule",
    "TruncationState",
    "VectorizedTruncatedStep",
]
