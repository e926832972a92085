"""The estimate record that crosses from workers to the learner, and its aggregation.

Workers (in the driver or in Ray actors) produce :class:`Estimate` records of
host numpy arrays; populations gather them; the run loop combines them with
:func:`aggregate` and hands the result to the learner. This module sits below
all three, so each of them imports it without reaching into another.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
    """The combined estimate of one learner step.

    Attributes:
      grad: weighted mean gradient; None when no estimate was usable.
      mean_loss: weighted mean meta-loss.
      num_used: estimates behind it.
      num_rejected_nonfinite: non-finite estimates left out.
      total_weight: sum of the used estimates' weights.
      family_losses: per task family of a mixture, the weighted mean of the
        estimates' ``meta_loss_by_family/<family>`` metrics (empty when no
        estimate reports any, i.e. a run on a single family).
    """

    grad: Any
    mean_loss: float
    num_used: int
    num_rejected_nonfinite: int
    total_weight: float
    family_losses: Mapping[str, float] = MappingProxyType({})


def is_finite_estimate(estimate: Estimate) -> bool:
    return bool(np.isfinite(estimate.mean_loss)) and all(
        np.all(np.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(estimate.grad)
    )


#: Estimates of at least this many floats are summed by XLA, smaller ones by numpy.
JIT_SUM_MIN_ELEMENTS = 1 << 18


def _sum_and_check(grads: list[Any], weights: Any) -> tuple[Any, Any]:
    """``sum_i weights[i] * grads[i]`` in list order, in one XLA pass, and its finiteness."""
    total = jax.tree_util.tree_map(
        lambda *leaves: sum(w * leaf for w, leaf in zip(weights, leaves, strict=True)), *grads
    )
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(total)]
    return total, functools.reduce(jnp.logical_and, checks)


_jit_sum_and_check = jax.jit(_sum_and_check)


def _numpy_sum_and_check(grads: list[Any], weights: np.ndarray) -> tuple[Any, bool]:
    """The same sum with numpy, written into one new buffer per leaf.

    Estimates of equal weight (the usual case: every worker's tasks are
    valid) are added first, in list order, and their sum scaled once, so no
    temporary is made per estimate: ``w * grad`` would allocate and fill one.
    """
    groups: dict[float, list[int]] = {}
    for index, weight in enumerate(weights):
        groups.setdefault(float(weight), []).append(index)

    def leaf_sum(*leaves: Any) -> np.ndarray:
        dtype = np.result_type(np.asarray(leaves[0]).dtype, weights.dtype)
        total = None
        for weight, members in groups.items():
            part = np.array(leaves[members[0]], dtype=dtype)
            for index in members[1:]:
                np.add(part, leaves[index], out=part)
            np.multiply(part, dtype.type(weight), out=part)
            total = part if total is None else np.add(total, part, out=total)
        return total

    total = jax.tree_util.tree_map(leaf_sum, *grads)
    finite = all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(total))
    return total, finite


def _weighted_sum(grads: list[Any], weights: np.ndarray) -> tuple[Any, bool]:
    """``sum_i weights[i] * grads[i]`` in list order, and whether all of it is finite.

    Large estimates go through one fused XLA pass (2 CPU threads, no numpy
    temporaries), which their host arrays enter without a copy: on CPU
    ``jax.device_put`` aliases aligned host arrays, and the arrays Ray returns
    from its object store are aligned. Below :data:`JIT_SUM_MIN_ELEMENTS` the
    call's fixed cost outweighs that and numpy sums them.
    """
    if sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(grads[0])) >= JIT_SUM_MIN_ELEMENTS:
        total, finite = _jit_sum_and_check(jax.device_put(grads), weights)
        return total, bool(finite)
    return _numpy_sum_and_check(grads, weights)


def _weighted_mean(usable: Sequence[Estimate]) -> tuple[Any, np.ndarray, float, bool]:
    """The estimates' mean weighted by ``weight``, the weights used, their total, finiteness."""
    total = float(sum(e.weight for e in usable))
    weights = np.asarray([e.weight / total for e in usable], np.float32)
    grad, finite = _weighted_sum([e.grad for e in usable], weights)
    return grad, weights, total, finite


def aggregate(estimates: Sequence[Estimate]) -> Aggregate:
    """Weighted mean of the finite estimates, in the order given.

    Non-finite estimates are counted and never applied; estimates of zero
    weight contribute nothing. The order is part of the result (floating-point
    sums), so callers that need determinism pass estimates in worker-rank order.

    The estimates are read once: a non-finite estimate is found from the sum
    (a NaN or infinity in an estimate leaves one in the sum, since every
    summed weight is positive), and only then are the estimates checked one by
    one. Large estimates are summed in one XLA pass whose result the learner's
    jitted update takes where it lies (see :func:`_weighted_sum`).
    """
    finite_loss = [e for e in estimates if np.isfinite(e.mean_loss)]
    rejected = len(estimates) - len(finite_loss)
    # Zero-weight estimates are never summed; check them here so they are counted.
    rejected += sum(not is_finite_estimate(e) for e in finite_loss if e.weight <= 0)
    usable = [e for e in finite_loss if e.weight > 0]
    if not usable:
        return Aggregate(None, float("nan"), 0, rejected, 0.0)
    grad, weights, total, finite = _weighted_mean(usable)
    if not finite:
        finite_usable = [e for e in usable if is_finite_estimate(e)]
        if not finite_usable:
            return Aggregate(None, float("nan"), 0, rejected + len(usable), 0.0)
        if len(finite_usable) < len(usable):
            # Every estimate left is finite: the sum is applied as it comes out.
            rejected += len(usable) - len(finite_usable)
            usable = finite_usable
            grad, weights, total, _ = _weighted_mean(usable)
    mean_loss = float(sum(w * e.mean_loss for w, e in zip(weights, usable, strict=True)))
    family_losses: dict[str, float] = {}
    for w, e in zip(weights, usable, strict=True):
        for name, value in e.metrics.items():
            if name.startswith(FAMILY_LOSS_METRIC):
                family = name[len(FAMILY_LOSS_METRIC) :]
                family_losses[family] = family_losses.get(family, 0.0) + float(w * value)
    return Aggregate(grad, mean_loss, len(usable), rejected, total, MappingProxyType(family_losses))
