"""Combining K consecutive truncations into one estimate: keys, checks and weighted sums.

An estimate from K truncations is the weight-weighted mean of the K
single-truncation estimates, where a truncation's weight is the number of its
tasks that had at least one valid step. Integer and boolean metrics are counts
and are summed instead. These functions are pure and jittable; the estimators'
``estimate_many`` uses them inside one ``lax.scan``, and the runners' host-data
path applies them between separate jitted calls, so both paths combine the
truncations with the same operations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "WeightedSums",
    "accumulate",
    "check_num_truncations",
    "truncation_keys",
    "weighted_means",
    "zero_sums",
]

PyTree = Any


def check_num_truncations(num_truncations: int) -> int:
    """``num_truncations`` as a Python int, checked.

    Args:
      num_truncations: K, the truncations behind one estimate; it fixes a scan
        length, so it must be a Python integer (not a traced value).

    Returns:
      ``int(num_truncations)``.

    Raises:
      TypeError: if it is a bool or not integral.
      ValueError: if it is below 1.
    """
    if isinstance(num_truncations, bool) or int(num_truncations) != num_truncations:
        raise TypeError(f"num_truncations must be an int, got {num_truncations!r}")
    if num_truncations < 1:
        raise ValueError(f"num_truncations must be >= 1, got {num_truncations}")
    return int(num_truncations)


def truncation_keys(key: jax.Array, num_truncations: int) -> jax.Array:
    """Keys of the K truncations behind one estimate, stacked on axis 0.

    The first is ``key`` itself, so that one truncation is exactly ``estimate``
    with ``key``; truncation ``k >= 1`` uses ``jax.random.fold_in(key, k)``.
    Callers that derive further keys from ``key`` must therefore not use
    ``fold_in(key, k)`` for ``k >= 1``.

    Args:
      key: the key of the call (typed or raw uint32).
      num_truncations: K.

    Returns:
      K keys shaped like ``key`` with a new leading axis.
    """
    num_truncations = check_num_truncations(num_truncations)
    first = key[None]
    if num_truncations == 1:
        return first
    indices = jnp.arange(1, num_truncations, dtype=jnp.uint32)
    rest = jax.vmap(lambda i: jax.random.fold_in(key, i))(indices)
    return jnp.concatenate([first, rest])


class WeightedSums(NamedTuple):
    """Sums over the truncations seen so far.

    Attributes:
      grad: ``sum_k w_k grad_k`` (theta-shaped).
      loss: ``sum_k w_k mean_loss_k``.
      weight: ``sum_k w_k``.
      metrics: per metric, ``sum_k m_k`` for counts (integer or boolean
        metrics, summed as integers) and ``sum_k w_k m_k`` for the others.
    """

    grad: PyTree
    loss: jax.Array
    weight: jax.Array
    metrics: dict[str, jax.Array]


def _is_count(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_)


def _count_dtype(x: Any) -> Any:
    # Booleans sum to counts.
    return jnp.int32 if jnp.issubdtype(x.dtype, jnp.bool_) else x.dtype


def zero_sums(out: Any, metrics: dict[str, Any]) -> WeightedSums:
    """Zero sums shaped like one truncation's estimate.

    Args:
      out: an ``EstimatorOut`` (or one of shape structs, from ``jax.eval_shape``);
        only ``grad``, ``mean_loss`` and ``weight`` are read.
      metrics: the truncation's metrics (arrays or shape structs).

    Returns:
      All-zero :class:`WeightedSums`; boolean metrics get int32 sums.
    """

    def zeros(x, dtype=None):
        return jnp.zeros(jnp.shape(x), dtype or x.dtype)

    return WeightedSums(
        grad=jax.tree_util.tree_map(zeros, out.grad),
        loss=zeros(out.mean_loss),
        weight=zeros(out.weight),
        metrics={
            name: zeros(m, _count_dtype(m) if _is_count(m) else None) for name, m in metrics.items()
        },
    )


def accumulate(sums: WeightedSums, out: Any, metrics: dict[str, jax.Array]) -> WeightedSums:
    """Adds one truncation's estimate to the sums.

    Args:
      sums: the sums so far (from :func:`zero_sums` or a previous call).
      out: the truncation's ``EstimatorOut``; ``grad``, ``mean_loss`` and
        ``weight`` are read, ``state`` is ignored.
      metrics: the truncation's metrics, with the names of ``sums.metrics``.

    Returns:
      The updated sums.
    """
    weight = out.weight

    def weighted(total, x):
        return total + weight.astype(x.dtype) * x

    return WeightedSums(
        grad=jax.tree_util.tree_map(weighted, sums.grad, out.grad),
        loss=weighted(sums.loss, out.mean_loss),
        weight=sums.weight + weight,
        metrics={
            name: total + metrics[name].astype(total.dtype)
            if _is_count(metrics[name])
            else weighted(total, metrics[name])
            for name, total in sums.metrics.items()
        },
    )


def weighted_means(
    sums: WeightedSums,
) -> tuple[PyTree, jax.Array, jax.Array, dict[str, jax.Array]]:
    """The combined estimate from the sums.

    Args:
      sums: the sums over all K truncations.

    Returns:
      ``(grad, mean_loss, weight, metrics)``: grad, mean loss and non-count
      metrics are weight-weighted means (zero, not NaN, when every weight is
      zero), ``weight`` is the total weight and counts stay summed.
    """
    total = sums.weight
    # The sums are all zero when every weight is; dividing by 1 then keeps them zero.
    denom = jnp.where(total > 0, total, jnp.ones_like(total))

    def mean(x):
        return x / denom.astype(x.dtype)

    metrics = {
        name: value if _is_count(value) else mean(value) for name, value in sums.metrics.items()
    }
    grad = jax.tree_util.tree_map(mean, sums.grad)
    return grad, mean(sums.loss), total, metrics
