"""Gradient estimators: ``estimator.kind`` -> a ``GradientEstimator``.

An estimator's callable takes the truncated step and the truncation schedule
first, then its fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from popmeta.core.estimators import (
    FullES,
    GradientEstimator,
    NoiseReuseES,
    TruncatedES,
    TruncatedGrad,
    TruncatedPES,
)
from popmeta.core.truncated_step import TruncatedStep
from popmeta.core.truncation import TruncationSchedule
from popmeta.registry.kinds import PositiveFloat, PositiveInt, Registry

__all__ = ["ESTIMATORS"]

ESTIMATORS: Registry[GradientEstimator] = Registry(
    "estimator",
    "Gradient estimators",
    "a `GradientEstimator` (built on the truncated step and the truncation schedule)",
    returns=GradientEstimator,
    leading=2,
)


def _truncated_antithetic(estimator: type) -> Callable[..., GradientEstimator]:
    """The kind of an antithetic estimator over truncations (PES, NRES, truncated ES)."""

    def build(
        truncated_step: TruncatedStep,
        schedule: TruncationSchedule,
        trunc_length: PositiveInt = 10,
        std: PositiveFloat = 0.01,
        sign_delta_loss_scalar: PositiveFloat | None = None,
        clip_loss_diff: PositiveFloat | None = None,
    ) -> GradientEstimator:
        """Args:
        trunc_length: inner steps per truncation.
        std: standard deviation sigma of the perturbations.
        sign_delta_loss_scalar: if set, the antithetic loss difference becomes sign(delta) * scalar.
        clip_loss_diff: if set, the antithetic loss difference is clipped to +-value.
        """
        del schedule
        return estimator(truncated_step, trunc_length, std, sign_delta_loss_scalar, clip_loss_diff)

    return build


ESTIMATORS.register("pes", "Persistent ES: unbiased, persistent antithetic states")(
    _truncated_antithetic(TruncatedPES)
)
ESTIMATORS.register("nres", "Noise-reuse ES: PES's mean with lower variance")(
    _truncated_antithetic(NoiseReuseES)
)
ESTIMATORS.register("truncated_es", "antithetic ES per truncation (biased)")(
    _truncated_antithetic(TruncatedES)
)


def _needs_a_constant_schedule(config: Any, where: str, section: Any) -> Iterator[tuple[str, str]]:
    del section
    if config.truncation.kind != "constant" and ":" not in config.truncation.kind:
        yield (
            f"{where}.kind",
            "'full_es' unrolls whole episodes of truncation.length steps and needs "
            f"truncation.kind: constant, got truncation.kind: {config.truncation.kind!r}",
        )


@ESTIMATORS.register(
    "full_es",
    "antithetic ES over whole episodes of the constant schedule's `length` steps",
    rules=_needs_a_constant_schedule,
)
def full_es(
    truncated_step: TruncatedStep,
    schedule: TruncationSchedule,
    std: PositiveFloat = 0.01,
    sign_delta_loss_scalar: PositiveFloat | None = None,
    clip_loss_diff: PositiveFloat | None = None,
) -> GradientEstimator:
    """Args:
    std: standard deviation sigma of the perturbations.
    sign_delta_loss_scalar: if set, the antithetic loss difference becomes sign(delta) * scalar.
    clip_loss_diff: if set, the antithetic loss difference is clipped to +-value.
    """
    return FullES(truncated_step, schedule, std, sign_delta_loss_scalar, clip_loss_diff)


@ESTIMATORS.register("truncated_grad", "truncated backpropagation through the unroll (biased)")
def truncated_grad(
    truncated_step: TruncatedStep, schedule: TruncationSchedule, trunc_length: PositiveInt = 10
) -> GradientEstimator:
    """Args:
    trunc_length: inner steps per truncation.
    """
    del schedule
    return TruncatedGrad(truncated_step, trunc_length)
