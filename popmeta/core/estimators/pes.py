"""Persistent evolution strategies (PES; Vicol et al., 2021).

Fresh noise every truncation; the + and - members keep their own persistent
states, and each task accumulates every perturbation its current trajectory has
seen. Unbiased for the gradient of each truncation's loss through the whole
trajectory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.estimators.antithetic import AntitheticEstimator, ends_with_reset
from popmeta.core.tree_utils import per_task, select_tasks, stack_members, tree_add, tree_zeros_like

__all__ = ["PESWorkerState", "TruncatedPES"]


class PESWorkerState(NamedTuple):
    member_states: Any  # leading axis: (+, -)
    accumulator: Any  # theta-shaped with a task axis: noise of the current trajectory
    starts_with_reset: jax.Array  # [tasks]


class TruncatedPES(AntitheticEstimator):
    """PES gradient estimates from truncations of ``trunc_length`` steps.

    Arguments as for :class:`AntitheticEstimator`.
    """

    def init_worker_state(self, theta, key, outer_state=None):
        num_tasks = self.truncated_step.num_tasks
        state = self.truncated_step.init_step_state(theta, outer_state, key)
        return PESWorkerState(
            member_states=stack_members(state, 2),
            accumulator=jax.tree_util.tree_map(
                lambda t: jnp.zeros((num_tasks, *jnp.shape(t)), jnp.result_type(t)), theta
            ),
            starts_with_reset=jnp.zeros((num_tasks,), bool),
        )

    def estimate(self, theta, state, key, data=None, outer_state=None):
        key_noise, key_unroll = jax.random.split(key)
        noise = self._noise(key_noise, theta)
        unrolled, deltas = self._unroll(
            theta,
            (1.0, -1.0),
            noise,
            noise,
            state.member_states,
            state.starts_with_reset,
            key_unroll,
            data,
            outer_state,
        )
        with_history = tree_add(state.accumulator, noise)
        per_task_grad = tree_add(
            per_task(deltas.first, with_history), per_task(deltas.after, noise)
        )

        # The accumulator restarts with a trajectory: it holds this truncation's noise
        # if the trajectory now running began inside it, nothing if it begins next.
        pending_reset = ends_with_reset(unrolled)
        accumulator = select_tasks(unrolled.in_first[-1], with_history, noise)
        accumulator = select_tasks(pending_reset, tree_zeros_like(accumulator), accumulator)
        new_state = PESWorkerState(unrolled.state, accumulator, pending_reset)
        return self._output(per_task_grad, deltas, unrolled, new_state)
