"""Gradient-estimator protocol, and several truncations per call.

Every estimator exposes a pure ``estimate(theta, state, key, data, outer_state)``
(jittable, vmappable over seeds) and a convenience
``compute_gradient_estimate(theta, state, key)`` that fetches host data, if the
truncated step has any, and calls the jitted ``estimate`` with the worker state
donated. A whole truncation is one jitted call (a ``lax.scan`` over its steps).

``estimate_many(theta, state, key, num_truncations)`` runs several consecutive
truncations in one call (a ``lax.scan`` over ``estimate``) and returns their
weight-weighted mean, which amortises the per-call overhead when one truncation
takes about as long as a round trip to the learner.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.truncated_step import TruncatedStep

__all__ = ["EstimatorOut", "GradientEstimator", "task_mean", "truncation_keys"]

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


class GradientEstimator:
    """Turns truncations of a vectorized truncated step into gradient estimates."""

    truncated_step: TruncatedStep
    trunc_length: int
    #: Unrolls per task per step (2 for antithetic pairs); for throughput accounting.
    num_members: int = 2

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        raise NotImplementedError

    def estimate(
        self, theta: PyTree, state: Any, key: jax.Array, data: Any = None, outer_state: Any = None
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Pure, jittable estimate from one truncation."""
        raise NotImplementedError

    def unroll_state(self, state: Any) -> Any:
        """The truncated step's state inside ``state`` (the + member's, for ES), or None."""
        members = getattr(state, "member_states", None)
        if members is not None:
            return jax.tree_util.tree_map(lambda x: x[0], members)
        return getattr(state, "unroll_state", None)

    def estimate_many(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        num_truncations: int,
        data: Any = None,
        outer_state: Any = None,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Pure, jittable estimate from ``num_truncations`` consecutive truncations.

        Truncation ``k`` is ``estimate`` with key ``truncation_keys(key, K)[k]``
        and the state left by truncation ``k - 1``; all of them run in one
        ``lax.scan``, so a jitted call costs one dispatch however large ``K``.

        Args:
          theta: meta-parameters.
          state: worker state from ``init_worker_state`` or a previous call.
          key: key of the call; with ``num_truncations == 1`` the result is
            exactly ``estimate(theta, state, key, ...)``.
          num_truncations: K, a Python int (it fixes the scan length).
          data: None to sample data on device, or one truncation's data per
            truncation stacked on a new leading axis of size K.
          outer_state: passed through to ``estimate``.

        Returns:
          ``(EstimatorOut, metrics)``: ``grad`` and ``mean_loss`` are the
          weight-weighted means of the K estimates (zero when every weight is
          zero), ``weight`` their sum and ``state`` the final state. Integer and
          boolean metrics (counts) are summed; the others are weight-weighted
          means like ``mean_loss``.
        """
        num_truncations = _check_num_truncations(num_truncations)
        first = None if data is None else jax.tree_util.tree_map(lambda x: x[0], data)
        if num_truncations == 1:
            # No scan and no reweighting: bit-for-bit the single-truncation estimate.
            return self.estimate(theta, state, key, first, outer_state)
        keys = truncation_keys(key, num_truncations)
        # Zero sums shaped like one truncation's output (traced, never run).
        running = _zero_running(
            *jax.eval_shape(self.estimate, theta, state, key, first, outer_state)
        )

        def body(carry, xs):
            state, running = carry
            truncation_key, truncation_data = xs
            out, metrics = self.estimate(theta, state, truncation_key, truncation_data, outer_state)
            return (out.state, _accumulate(running, out, metrics)), None

        (state, running), _ = jax.lax.scan(
            body, (state, running), (keys, data), length=num_truncations
        )
        return _finish(running, state)

    def state_task_axes(self, state: Any) -> Any:
        """The task axis of every leaf of ``state``, as a pytree of ints shaped like it.

        Sharding the tasks over devices splits each leaf along this axis. The
        default follows the conventions of the built-in estimators: leaves
        under a ``member_states`` field have the antithetic member axis first
        and the task axis second; every other leaf leads with the task axis.
        Estimators whose state differs override this.
        """
        if isinstance(state, tuple) and hasattr(state, "_fields"):
            return type(state)(
                *(
                    _axes_like(value, 1 if name == "member_states" else 0)
                    for name, value in zip(state._fields, state, strict=True)
                )
            )
        return _axes_like(state, 0)

    @functools.cached_property
    def _jitted_estimate(self):
        return jax.jit(self.estimate, donate_argnums=(1,))

    @functools.cached_property
    def _jitted_estimate_many_cache(self) -> dict[int, Any]:
        return {}

    def jitted_estimate_many(self, num_truncations: int) -> Any:
        """``estimate_many`` for a fixed K, jitted with the state donated.

        The returned callable takes ``(theta, state, key, data, outer_state)``.
        One compiled function per K, reused across calls.
        """
        num_truncations = _check_num_truncations(num_truncations)
        fn = self._jitted_estimate_many_cache.get(num_truncations)
        if fn is None:
            fn = jax.jit(_fixed_truncations(self, num_truncations), donate_argnums=(1,))
            self._jitted_estimate_many_cache[num_truncations] = fn
        return fn

    @functools.cached_property
    def jitted_init_worker_state(self):
        return jax.jit(self.init_worker_state)

    def compute_gradient_estimate(
        self, theta: PyTree, state: Any, key: jax.Array, outer_state: Any = None
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """One estimate; ``state`` is donated and must not be used afterwards."""
        data = self.truncated_step.get_batch(self.trunc_length)
        return self._jitted_estimate(theta, state, key, data, outer_state)

    def compute_gradient_estimates(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        num_truncations: int,
        outer_state: Any = None,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """One estimate from ``num_truncations`` truncations; ``state`` is donated.

        With on-device data this is one jitted ``estimate_many`` call. If the
        truncated step supplies host data, the truncations run as separate
        jitted calls, each with its own batch from ``get_batch``, and are
        combined exactly as ``estimate_many`` combines them. With one truncation
        this is ``compute_gradient_estimate``.
        """
        if _check_num_truncations(num_truncations) == 1:
            return self.compute_gradient_estimate(theta, state, key, outer_state)
        return run_truncations(
            self,
            self._jitted_estimate,
            self.jitted_estimate_many(num_truncations),
            theta,
            state,
            key,
            num_truncations,
            outer_state,
        )


def _check_num_truncations(num_truncations: int) -> int:
    if isinstance(num_truncations, bool) or int(num_truncations) != num_truncations:
        raise TypeError(f"num_truncations must be an int, got {num_truncations!r}")
    if num_truncations < 1:
        raise ValueError(f"num_truncations must be >= 1, got {num_truncations}")
    return int(num_truncations)


def _fixed_truncations(estimator: GradientEstimator, num_truncations: int):
    """``estimate_many`` with K bound, taking the same arguments as ``estimate``."""

    def estimate_k(theta, state, key, data=None, outer_state=None):
        return estimator.estimate_many(theta, state, key, num_truncations, data, outer_state)

    return estimate_k


def _axes_like(tree: Any, axis: int) -> Any:
    return jax.tree_util.tree_map(lambda _: axis, tree)


def truncation_keys(key: jax.Array, num_truncations: int) -> jax.Array:
    """Keys of the truncations behind one ``estimate_many`` call, stacked on axis 0.

    The first is ``key`` itself, so that one truncation is exactly ``estimate``
    with ``key``; truncation ``k >= 1`` uses ``jax.random.fold_in(key, k)``.
    Callers that derive further keys from ``key`` must therefore not use
    ``fold_in(key, k)`` for ``k >= 1``.
    """
    num_truncations = _check_num_truncations(num_truncations)
    first = key[None]
    if num_truncations == 1:
        return first
    indices = jnp.arange(1, num_truncations, dtype=jnp.uint32)
    rest = jax.vmap(lambda i: jax.random.fold_in(key, i))(indices)
    return jnp.concatenate([first, rest])


class _Running(NamedTuple):
    """Weighted sums over the truncations seen so far."""

    grad: PyTree  # sum_k w_k grad_k
    loss: jax.Array  # sum_k w_k mean_loss_k
    weight: jax.Array  # sum_k w_k
    metrics: dict[str, jax.Array]  # counts: sum_k m_k; others: sum_k w_k m_k


def _is_count(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_)


def _count_dtype(x: Any) -> Any:
    # Booleans sum to counts.
    return jnp.int32 if jnp.issubdtype(x.dtype, jnp.bool_) else x.dtype


def _zero_running(out: EstimatorOut, metrics: dict[str, Any]) -> _Running:
    """Zero sums shaped like one estimate (``out`` and ``metrics`` may be shape structs)."""

    def zeros(x, dtype=None):
        return jnp.zeros(jnp.shape(x), dtype or x.dtype)

    return _Running(
        grad=jax.tree_util.tree_map(zeros, out.grad),
        loss=zeros(out.mean_loss),
        weight=zeros(out.weight),
        metrics={
            name: zeros(m, _count_dtype(m) if _is_count(m) else None) for name, m in metrics.items()
        },
    )


def _accumulate(running: _Running, out: EstimatorOut, metrics: dict[str, jax.Array]) -> _Running:
    """Adds one truncation's estimate to the running weighted sums."""
    weight = out.weight

    def weighted(total, x):
        return total + weight.astype(x.dtype) * x

    return _Running(
        grad=jax.tree_util.tree_map(weighted, running.grad, out.grad),
        loss=weighted(running.loss, out.mean_loss),
        weight=running.weight + weight,
        metrics={
            name: total + metrics[name].astype(total.dtype)
            if _is_count(metrics[name])
            else weighted(total, metrics[name])
            for name, total in running.metrics.items()
        },
    )


def _finish(running: _Running, state: Any) -> tuple[EstimatorOut, dict[str, jax.Array]]:
    """Weighted means from the running sums; all-zero weights give zero means."""
    total = running.weight
    # The sums are all zero when every weight is; dividing by 1 then keeps them zero.
    denom = jnp.where(total > 0, total, jnp.ones_like(total))

    def mean(x):
        return x / denom.astype(x.dtype)

    metrics = {
        name: value if _is_count(value) else mean(value) for name, value in running.metrics.items()
    }
    grad = jax.tree_util.tree_map(mean, running.grad)
    return EstimatorOut(grad, mean(running.loss), total, state), metrics


@jax.jit
def _jitted_accumulate(
    running: _Running, out: EstimatorOut, metrics: dict[str, jax.Array]
) -> _Running:
    return _accumulate(running, out, metrics)


_jitted_finish = jax.jit(_finish)


def run_truncations(
    estimator: GradientEstimator,
    estimate_fn: Any,
    estimate_many_fn: Any,
    theta: PyTree,
    state: Any,
    key: jax.Array,
    num_truncations: int,
    outer_state: Any = None,
) -> tuple[EstimatorOut, dict[str, jax.Array]]:
    """Host driver of a K-truncation estimate with compiled functions supplied by the caller.

    Args:
      estimator: supplies the truncated step (for host data) and trunc_length.
      estimate_fn: compiled ``estimate``, ``(theta, state, key, data, outer_state)``.
      estimate_many_fn: compiled ``estimate_many`` for this K, same arguments.
      theta, state, key, num_truncations, outer_state: as for ``estimate_many``;
        ``state`` is donated.

    Returns:
      What ``estimate_many`` returns. On-device data: one ``estimate_many_fn``
      call. Host data: K ``estimate_fn`` calls, one batch each, combined with
      the same weighted sums as ``estimate_many``.
    """
    step = estimator.truncated_step
    data = step.get_batch(estimator.trunc_length)
    if data is None:
        return estimate_many_fn(theta, state, key, None, outer_state)
    keys = truncation_keys(key, num_truncations)
    running = None
    for k in range(num_truncations):
        if k:
            data = step.get_batch(estimator.trunc_length)
        out, metrics = estimate_fn(theta, state, keys[k], data, outer_state)
        state = out.state
        if running is None:
            running = _zero_running(out, metrics)
        running = _jitted_accumulate(running, out._replace(state=()), metrics)
    return _jitted_finish(running, state)


def task_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    return (x * valid).sum() / jnp.maximum(valid.sum(), 1)
