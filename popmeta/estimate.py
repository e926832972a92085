"""The estimate record that crosses from workers to the learner, and its aggregation.

Workers (in the driver or in Ray actors) produce :class:`Estimate` records of
host numpy arrays; populations gather them; the learner chooses and weights
them with :func:`aggregate` and sums them inside its jitted update. This
module sits below all three, so each of them imports it without reaching into
another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import numpy as np

from popmeta.core.estimators import FAMILY_LOSS_METRIC

__all__ = ["Aggregate", "Estimate", "aggregate", "is_finite_estimate"]


class Estimate(NamedTuple):
    """One worker's estimate as the learner receives it (host numpy arrays).

    Attributes:
      grad: theta-shaped gradient estimate.
      mean_loss: mean meta-loss of the truncation behind it.
      weight: number of valid samples (tasks) behind it.
      version: theta version it was computed on.
      worker: rank of the worker that computed it.
      metrics: scalar diagnostics from the estimator.
      phases: each task's position in its trajectory (iteration / length, in
        [0, 1]) after the call, or None where the truncated step has no
        trajectories; a population whose tasks run in lockstep shows one value.
    """

    grad: Any
    mean_loss: float
    weight: float
    version: int
    worker: int
    metrics: dict[str, float]
    phases: np.ndarray | None = None


class Aggregate(NamedTuple):
    """One learner step's estimates, chosen and weighted; the learner sums them.

    The gradients are not summed here: the learner's jitted step
    (:func:`popmeta.learner.train_state.build_apply_estimates_fn`) reads them
    where ``ray.get`` left them and sums them inside the update, so the round's
    mean gradient is never written out on its own.

    Attributes:
      grads: the used estimates' gradients, in the order given; empty when no
        estimate was usable.
      weights: float32 weight of each of ``grads`` (its ``weight`` over
        ``total_weight``: they sum to 1).
      mean_loss: weighted mean meta-loss (NaN when nothing was usable).
      num_used: estimates behind it.
      num_rejected_nonfinite: non-finite estimates left out.
      total_weight: sum of the used estimates' weights.
      family_losses: per task family of a mixture, the weighted mean of the
        estimates' ``meta_loss_by_family/<family>`` metrics (empty when no
        estimate reports any, i.e. a run on a single family).
    """

    grads: tuple[Any, ...]
    weights: np.ndarray
    mean_loss: float
    num_used: int
    num_rejected_nonfinite: int
    total_weight: float
    family_losses: Mapping[str, float] = MappingProxyType({})


def is_finite_estimate(estimate: Estimate) -> bool:
    return bool(np.isfinite(estimate.mean_loss)) and all(
        np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(estimate.grad)
    )


def aggregate(estimates: Sequence[Estimate], check_grads: bool = False) -> Aggregate:
    """The estimates to use, in the order given, and their weights.

    An estimate is used if its loss is finite and its weight positive;
    estimates of zero weight contribute nothing, and a non-finite one among
    them is counted. The order is part of the result (floating-point sums),
    so callers that need determinism pass estimates in worker-rank order.

    With ``check_grads=False`` the gradients are not read here: a NaN or an
    infinity in one of them shows in the learner's sum, which the learner then
    refuses, and only then is aggregation repeated with ``check_grads=True``,
    which leaves out (and counts) every estimate with a non-finite gradient.
    That way each estimate is read once per round, by the update itself.
    """
    finite_loss = [e for e in estimates if math.isfinite(e.mean_loss)]
    rejected = len(estimates) - len(finite_loss)
    # Zero-weight estimates are never summed; check them here so they are counted.
    rejected += sum(not is_finite_estimate(e) for e in finite_loss if e.weight <= 0)
    usable = [e for e in finite_loss if e.weight > 0]
    if check_grads:
        finite = [e for e in usable if is_finite_estimate(e)]
        rejected += len(usable) - len(finite)
        usable = finite
    if not usable:
        return Aggregate((), np.zeros(0, np.float32), float("nan"), 0, rejected, 0.0)
    total = float(sum(e.weight for e in usable))
    weights = np.asarray([e.weight / total for e in usable], np.float32)
    # The losses are averaged with the weights the gradients get (float32), in float64.
    host_weights = weights.tolist()
    mean_loss = sum(w * float(e.mean_loss) for w, e in zip(host_weights, usable, strict=True))
    family_losses: dict[str, float] = {}
    for w, e in zip(host_weights, usable, strict=True):
        for name, value in e.metrics.items():
            if name.startswith(FAMILY_LOSS_METRIC):
                family = name[len(FAMILY_LOSS_METRIC) :]
                family_losses[family] = family_losses.get(family, 0.0) + w * float(value)
    return Aggregate(
        tuple(e.grad for e in usable),
        weights,
        mean_loss,
        len(usable),
        rejected,
        total,
        MappingProxyType(family_losses),
    )
