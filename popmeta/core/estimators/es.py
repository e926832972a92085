"""Antithetic evolution strategies over whole episodes (FullES) or truncations (TruncatedES)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.estimators.antithetic import AntitheticEstimator, ends_with_reset
from popmeta.core.tree_utils import per_task, stack_members
from popmeta.core.truncated_step import TruncatedStep
from popmeta.core.truncation import TruncationSchedule

__all__ = ["FullES", "TruncatedES", "TruncatedESWorkerState"]


class FullES(AntitheticEstimator):
    """Antithetic ES over whole episodes, started fresh on every call.

    One perturbation per task per episode. Every call starts fresh tasks from
    ``truncated_step.init_episode_state``: at the very start of their
    trajectories, whatever ``random_initial_iteration_offset`` the step was
    built with (the offset spreads a persistent population's resets; an
    episode that started part-way would be a shortened trajectory, a reset and
    an unfinished one). With an episode length equal to the schedule's
    constant length, each episode is exactly one whole trajectory, and the
    estimate is unbiased for the gradient of its mean meta-loss (of the
    Gaussian-smoothed loss, which is the loss itself when it is quadratic in
    theta). Each call costs a whole episode.

    Args:
      truncated_step: a vectorized truncated step (``num_tasks`` attribute).
      truncation_schedule: episode length: a ``ConstantTruncationSchedule`` or an int.
      std: perturbation standard deviation.
      sign_delta_loss_scalar: if set, replace each loss difference by its sign times this.
      clip_loss_diff: if set, clip each loss difference to ``[-c, c]``.
    """

    def __init__(
        self,
        truncated_step: TruncatedStep,
        truncation_schedule: TruncationSchedule | int,
        std: float = 0.01,
        sign_delta_loss_scalar: float | None = None,
        clip_loss_diff: float | None = None,
    ):
        if isinstance(truncation_schedule, int):
            length = truncation_schedule
        else:
            length = getattr(truncation_schedule, "total_length", None)
            if length is None:
                raise ValueError(
                    "FullES needs a fixed episode length: pass an int or a "
                    f"ConstantTruncationSchedule, got {type(truncation_schedule).__name__}"
                )
        super().__init__(truncated_step, length, std, sign_delta_loss_scalar, clip_loss_diff)

    def init_worker_state(self, theta, key, outer_state=None):
        del theta, key, outer_state
        return ()

    def estimate(self, theta, state, key, data=None, outer_state=None):
        del state
        key_init, key_noise, key_unroll = jax.random.split(key, 3)
        start = self.truncated_step.init_episode_state(theta, outer_state, key_init)
        noise = self._noise(key_noise, theta)
        unrolled, deltas = self._unroll(
            theta,
            (1.0, -1.0),
            noise,
            noise,
            stack_members(start, 2),
            jnp.zeros((self.truncated_step.num_tasks,), bool),
            key_unroll,
            data,
            outer_state,
        )
        per_task_grad = per_task(deltas.first + deltas.after, noise)
        return self._output(per_task_grad, deltas, unrolled, ())


class TruncatedESWorkerState(NamedTuple):
    unroll_state: Any
    starts_with_reset: jax.Array  # [tasks]


class TruncatedES(AntitheticEstimator):
    """Antithetic ES over one truncation, both members starting from a shared state.

    Fresh noise each truncation. The shared state is advanced by an unperturbed
    third member, so the estimate ignores theta's influence on the state the
    truncation starts from: biased whenever that influence matters. Arguments
    as for :class:`AntitheticEstimator`.
    """

    num_members = 3

    def init_worker_state(self, theta, key, outer_state=None):
        num_tasks = self.truncated_step.num_tasks
        return TruncatedESWorkerState(
            self.truncated_step.init_step_state(theta, outer_state, key),
            jnp.zeros((num_tasks,), bool),
        )

    def estimate(self, theta, state, key, data=None, outer_state=None):
        key_noise, key_unroll = jax.random.split(key)
        noise = self._noise(key_noise, theta)
        unrolled, deltas = self._unroll(
            theta,
            (1.0, -1.0, 0.0),
            noise,
            noise,
            stack_members(state.unroll_state, 3),
            state.starts_with_reset,
            key_unroll,
            data,
            outer_state,
        )
        new_state = TruncatedESWorkerState(
            jax.tree_util.tree_map(lambda x: x[2], unrolled.state), ends_with_reset(unrolled)
        )
        per_task_grad = per_task(deltas.first + deltas.after, noise)
        return self._output(per_task_grad, deltas, unrolled, new_state)
