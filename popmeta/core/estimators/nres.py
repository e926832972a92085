"""Noise-reuse evolution strategies (NRES; Li et al., 2023).

One perturbation per task per trajectory, reused by every truncation of that
trajectory until it resets. Same mean as PES (unbiased), never higher variance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from popmeta.core.estimators.antithetic import (
    AntitheticEstimator,
    ends_with_reset,
    sample_perturbation,
)
from popmeta.core.tree_utils import per_task, select_tasks, stack_members, tree_add

__all__ = ["NRESWorkerState", "NoiseReuseES"]


class NRESWorkerState(NamedTuple):
    member_states: Any  # leading axis: (+, -)
    noise: Any  # per-task perturbation of the current trajectory
    starts_with_reset: Any  # [tasks]


class NoiseReuseES(AntitheticEstimator):
    """NRES gradient estimates from truncations of ``trunc_length`` steps.

    Arguments as for :class:`AntitheticEstimator`.
    """

    def init_worker_state(self, theta, key, outer_state=None):
        key_state, key_noise = jax.random.split(key)
        num_tasks = self.truncated_step.num_tasks
        state = self.truncated_step.init_step_state(theta, outer_state, key_state)
        return NRESWorkerState(
            member_states=stack_members(state, 2),
            noise=sample_perturbation(key_noise, theta, num_tasks, self.std),
            starts_with_reset=jax.numpy.zeros((num_tasks,), bool),
        )

    def estimate(self, theta, state, key, data=None, outer_state=None):
        key_noise, key_unroll = jax.random.split(key)
        fresh = self._noise(key_noise, theta)
        unrolled, deltas = self._unroll(
            theta,
            (1.0, -1.0),
            state.noise,
            fresh,
            state.member_states,
            state.starts_with_reset,
            key_unroll,
            data,
            outer_state,
        )
        per_task_grad = tree_add(per_task(deltas.first, state.noise), per_task(deltas.after, fresh))
        # A trajectory that began inside this truncation keeps the fresh noise; one
        # that begins with the next truncation's first step draws its own then.
        noise = select_tasks(unrolled.in_first[-1] & ~unrolled.is_done[-1], state.noise, fresh)
        new_state = NRESWorkerState(unrolled.state, noise, ends_with_reset(unrolled))
        return self._output(per_task_grad, deltas, unrolled, new_state)
