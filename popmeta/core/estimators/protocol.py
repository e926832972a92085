"""What an estimator returns, and what a runner needs from an estimator.

:class:`EstimatorOut` is one estimate. :class:`Estimator` is the structural
interface that :mod:`popmeta.core.estimators.runners` compiles and calls;
:class:`~popmeta.core.estimators.base.GradientEstimator` implements it. Keeping
the interface here lets the runners depend on it rather than on the base
class, which itself builds on the runners (``GradientEstimator.runner``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from popmeta.core.truncated_step import TruncatedStep

__all__ = ["Estimator", "EstimatorOut"]

PyTree = Any


class EstimatorOut(NamedTuple):
    """One gradient estimate of the meta-loss with respect to theta.

    Attributes:
      grad: theta-shaped estimate.
      mean_loss: mean meta-loss of the truncation (mean of the + and - members for ES).
      weight: number of tasks with at least one valid step behind ``grad``; the
        learner weights estimates by it.
      state: the worker state to pass to the next call.
    """

    grad: PyTree
    mean_loss: jax.Array
    weight: jax.Array
    state: Any


class Estimator(Protocol):
    """The pure side of a gradient estimator, as runners use it.

    Attributes:
      truncated_step: the vectorized truncated step it unrolls (supplies host
        data through ``get_batch`` and the number of tasks).
      trunc_length: inner steps per truncation.
    """

    truncated_step: TruncatedStep
    trunc_length: int

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        """Pure, jittable initial worker state."""
        ...

    def estimate(
        self, theta: PyTree, state: Any, key: jax.Array, data: Any = None, outer_state: Any = None
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Pure, jittable estimate from one truncation."""
        ...

    def estimate_many(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        num_truncations: int,
        data: Any = None,
        outer_state: Any = None,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Pure, jittable estimate from ``num_truncations`` consecutive truncations."""
        ...

    def state_task_axes(self, state: Any) -> Any:
        """The task axis of every leaf of ``state``, as a pytree of ints shaped like it."""
        ...
