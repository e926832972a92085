"""What an estimator returns: one estimate, and the worker state for the next call."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["EstimatorOut"]

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
