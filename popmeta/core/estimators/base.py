"""Gradient-estimator protocol, and several truncations per call.

Every estimator exposes a pure ``estimate(theta, state, key, data, outer_state)``
(jittable, vmappable over seeds): one truncation, one ``lax.scan`` over its
steps. ``estimate_many(theta, state, key, num_truncations)`` runs several
consecutive truncations in one ``lax.scan`` over ``estimate`` and returns their
weight-weighted mean, which amortises the per-call overhead when one truncation
takes about as long as a round trip to the learner.

``compute_gradient_estimate(theta, state, key)`` is the convenience for
interactive use: it fetches host data, if the truncated step has any, and calls
the jitted ``estimate`` with the worker state donated, through the estimator's
:class:`~popmeta.core.estimators.runners.SingleDeviceRunner` (``runner``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.core.estimators.runners import SingleDeviceRunner
from popmeta.core.estimators.truncations import (
    accumulate,
    check_num_truncations,
    truncation_keys,
    weighted_means,
    zero_sums,
)
from popmeta.core.truncated_step import TruncatedStep

__all__ = ["FAMILY_LOSS_METRIC", "GradientEstimator", "family_loss_metrics", "task_mean"]

#: Prefix of the per-family meta-loss metrics: ``meta_loss_by_family/<family>``.
FAMILY_LOSS_METRIC = "meta_loss_by_family/"

PyTree = Any


class GradientEstimator:
    """Turns truncations of a vectorized truncated step into gradient estimates.

    Attributes:
      truncated_step: the vectorized truncated step it unrolls.
      trunc_length: inner steps per truncation.
      num_members: unrolls per task per step (2 for antithetic pairs).
    """

    truncated_step: TruncatedStep
    trunc_length: int
    #: Unrolls per task per step (2 for antithetic pairs); for throughput accounting.
    num_members: int = 2

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        """Pure, jittable initial worker state: the persistent state behind successive estimates."""
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
        num_truncations = check_num_truncations(num_truncations)
        first = None if data is None else jax.tree_util.tree_map(lambda x: x[0], data)
        if num_truncations == 1:
            # No scan and no reweighting: bit-for-bit the single-truncation estimate.
            return self.estimate(theta, state, key, first, outer_state)
        keys = truncation_keys(key, num_truncations)
        # Zero sums shaped like one truncation's output (traced, never run).
        sums = zero_sums(*jax.eval_shape(self.estimate, theta, state, key, first, outer_state))

        def body(carry, xs):
            state, sums = carry
            truncation_key, truncation_data = xs
            out, metrics = self.estimate(theta, state, truncation_key, truncation_data, outer_state)
            return (out.state, accumulate(sums, out, metrics)), None

        (state, sums), _ = jax.lax.scan(body, (state, sums), (keys, data), length=num_truncations)
        grad, mean_loss, weight, metrics = weighted_means(sums)
        return EstimatorOut(grad, mean_loss, weight, state), metrics

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
    def runner(self) -> SingleDeviceRunner:
        """This estimator's single-device runner: its compiled functions, created on first use."""
        return SingleDeviceRunner(self)

    def compute_gradient_estimate(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        outer_state: Any = None,
        *,
        num_truncations: int = 1,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """One jitted estimate on the default device; ``state`` is donated.

        Fetches host data if the truncated step has any and runs the compiled
        ``estimate`` (``estimate_many`` for K > 1) of :attr:`runner`.

        Args:
          theta: meta-parameters.
          state: worker state from ``init_worker_state`` or the previous call;
            it is donated and must not be used afterwards.
          key: key of the call.
          outer_state: passed through to ``estimate``.
          num_truncations: K, consecutive truncations behind the estimate;
            1 is exactly ``estimate``.

        Returns:
          ``(EstimatorOut, metrics)``; ``out.state`` is the state for the next call.
        """
        return self.runner.compute_gradient_estimate(
            theta, state, key, outer_state, num_truncations=num_truncations
        )


def _axes_like(tree: Any, axis: int) -> Any:
    return jax.tree_util.tree_map(lambda _: axis, tree)


def task_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean of per-task ``x`` over the ``valid`` tasks (0 when none is valid)."""
    return (x * valid).sum() / jnp.maximum(valid.sum(), 1)


def family_loss_metrics(
    truncated_step: TruncatedStep, per_task_loss: jax.Array, valid: jax.Array
) -> dict[str, jax.Array]:
    """Mean loss of each family's valid tasks, for a step that mixes task families.

    A step mixes families when it has ``family_names`` and ``family_of_task``
    (each slot's index into ``family_names``), as
    :class:`~popmeta.core.mixture_truncated_step.MixtureTruncatedStep` does;
    other steps give no such metrics. A family none of whose tasks is valid
    reads 0 for that truncation.

    Returns:
      ``{FAMILY_LOSS_METRIC + name: mean loss}`` per family, or ``{}``.
    """
    names = getattr(truncated_step, "family_names", None)
    if not names:
        return {}
    family = jnp.asarray(truncated_step.family_of_task)
    return {
        f"{FAMILY_LOSS_METRIC}{name}": task_mean(per_task_loss, valid & (family == i))
        for i, name in enumerate(names)
    }
