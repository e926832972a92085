"""Noise-reuse evolution strategies (NRES; Li et al., 2023).

One perturbation per task per trajectory, reused by every truncation of that
trajectory until it resets. Same mean as PES (unbiased), never higher variance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from popmeta.core.estimators.base import (
    EstimatorOut,
    GradientEstimator,
    antithetic_deltas,
    ends_with_reset,
    es_metrics,
    perturbed_unroll,
    sample_perturbation,
    weighted_task_mean,
)
from popmeta.core.tree_utils import per_task, select_tasks, stack_members, tree_add
from popmeta.core.truncated_step import TruncatedStep

__all__ = ["NRESWorkerState", "NoiseReuseES"]


class NRESWorkerState(NamedTuple):
    member_states: Any  # leading axis: (+, -)
    noise: Any  # per-task perturbation of the current trajectory
    starts_with_reset: Any  # [tasks]


class NoiseReuseES(GradientEstimator):
    """NRES gradient estimates from truncations of ``trunc_length`` steps.

    Args:
      truncated_step: a vectorized truncated step (``num_tasks`` attribute).
      trunc_length: inner steps per truncation.
      std: perturbation standard deviation.
      sign_delta_loss_scalar: if set, replace each loss difference by its sign times this.
      clip_loss_diff: if set, clip each loss difference to ``[-c, c]``.
    """

    def __init__(
        self,
        truncated_step: TruncatedStep,
        trunc_length: int = 10,
        std: float = 0.01,
        sign_delta_loss_scalar: float | None = None,
        clip_loss_diff: float | None = None,
    ):
        self.truncated_step = truncated_step
        self.trunc_length = int(trunc_length)
        self.std = float(std)
        self.sign_delta_loss_scalar = sign_delta_loss_scalar
        self.clip_loss_diff = clip_loss_diff

    def init_worker_state(self, theta, key, outer_state=None):
        key_state, key_noise = jax.random.split(key)
        num_tasks = self.truncated_step.num_tasks
        state = self.truncated_step.init_step_state(theta, outer_state, key_state)
        return NRESWorkerState(
            member_states=stack_members(state, 2),
            noise=sample_perturbation(key_noise, theta, num_tasks, self.std),
            starts_with_reset=jax.numpy.zeros((num_tasks,), bool),
        )

    def state_task_axes(self, state):
        """Member states lead with the (+, -) axis, so their task axis is 1."""
        return NRESWorkerState(
            member_states=jax.tree_util.tree_map(lambda _: 1, state.member_states),
            noise=jax.tree_util.tree_map(lambda _: 0, state.noise),
            starts_with_reset=0,
        )

    def estimate(self, theta, state, key, data=None, outer_state=None):
        key_noise, key_unroll = jax.random.split(key)
        fresh = sample_perturbation(key_noise, theta, self.truncated_step.num_tasks, self.std)
        unrolled = perturbed_unroll(
            self.truncated_step,
            theta,
            (1.0, -1.0),
            state.noise,
            fresh,
            state.member_states,
            state.starts_with_reset,
            key_unroll,
            data,
            self.trunc_length,
            outer_state,
        )
        deltas = antithetic_deltas(unrolled, self.sign_delta_loss_scalar, self.clip_loss_diff)
        per_task_grad = tree_add(per_task(deltas.first, state.noise), per_task(deltas.after, fresh))
        grad = jax.tree_util.tree_map(
            lambda g: g / (2 * self.std**2), weighted_task_mean(per_task_grad, deltas.valid)
        )
        # A trajectory that began inside this truncation keeps the fresh noise; one
        # that begins with the next truncation's first step draws its own then.
        noise = select_tasks(unrolled.in_first[-1] & ~unrolled.is_done[-1], state.noise, fresh)
        new_state = NRESWorkerState(unrolled.state, noise, ends_with_reset(unrolled))
        metrics = es_metrics(deltas, unrolled)
        return (
            EstimatorOut(grad, metrics["mean_loss"], deltas.valid.sum(), new_state),
            metrics,
        )
