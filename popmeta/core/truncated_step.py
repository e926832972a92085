"""The truncated-step abstraction: one inner step of a meta-learned unrolled system.

A ``TruncatedStep`` is what gradient estimators unroll. Each call to
``unroll_step`` advances the inner problem by one step and reports a
``TruncatedUnrollOut``. By convention the step that ends a trajectory reports
``is_done=True`` and the *next* step resets the problem, reporting
``loss=0, mask=False, iteration=0``; estimators rely on that convention to tell
which steps belong to which trajectory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["TruncatedStep", "TruncatedUnrollOut", "VectorizedTruncatedStep"]


class TruncatedUnrollOut(NamedTuple):
    """What one unroll step reports (per task when vectorized)."""

    loss: jax.Array
    is_done: jax.Array
    task_param: Any
    iteration: jax.Array
    mask: jax.Array


class TruncatedStep:
    """One inner step of an unrolled computation, parameterised by theta.

    Subclasses implement the methods below; every method except ``get_batch``,
    ``get_outer_batch`` and ``task_name`` must be pure and jittable. The
    ``theta_is_vector`` flag tells a vectorized step that ``theta`` carries a
    leading task axis; single-task steps accept and ignore it.
    """

    def outer_init(self, key: jax.Array) -> Any:
        del key
        return None

    def init_step_state(
        self, theta: Any, outer_state: Any, key: jax.Array, theta_is_vector: bool = False
    ) -> Any:
        raise NotImplementedError

    def init_episode_state(
        self, theta: Any, outer_state: Any, key: jax.Array, theta_is_vector: bool = False
    ) -> Any:
        """A state at the very start of fresh trajectories, for whole-episode estimators.

        ``init_step_state`` may start each task part-way into its trajectory
        (a random initial offset, which keeps a population's resets apart);
        FullES unrolls whole episodes and starts from this state instead. The
        default is ``init_step_state``, for steps that have no such offset.
        """
        return self.init_step_state(theta, outer_state, key, theta_is_vector)

    def unroll_step(
        self,
        theta: Any,
        unroll_state: Any,
        key: jax.Array,
        data: Any,
        outer_state: Any,
        theta_is_vector: bool = False,
    ) -> tuple[Any, TruncatedUnrollOut]:
        raise NotImplementedError

    def unroll_members(
        self, thetas: Any, unroll_states: Any, key: jax.Array, data: Any, outer_state: Any
    ) -> tuple[Any, TruncatedUnrollOut]:
        """One step of several members (e.g. the antithetic + and -) on the same key and data.

        ``thetas`` and ``unroll_states`` lead with a member axis, then (for a
        vectorized step) the task axis. The default vmaps ``unroll_step``;
        steps override it when work can be shared across members.
        """
        return jax.vmap(
            functools.partial(self.unroll_step, theta_is_vector=True),
            in_axes=(0, 0, None, None, None),
        )(thetas, unroll_states, key, data, outer_state)

    def meta_loss_batch(
        self,
        theta: Any,
        unroll_state: Any,
        key: jax.Array,
        data: Any,
        outer_state: Any,
        theta_is_vector: bool = False,
    ) -> jax.Array:
        raise NotImplementedError

    def get_batch(self, steps: int | None = None) -> Any:
        """Host data for ``steps`` unroll steps, or None when data is sampled inside jit."""
        del steps
        return None

    def get_outer_batch(self, steps: int | None = None) -> Any:
        del steps
        return None

    def task_name(self) -> str:
        return type(self).__name__


def _stack(trees: list[Any], axis: int) -> Any:
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs, axis=axis), *trees)


class VectorizedTruncatedStep(TruncatedStep):
    """Runs ``num_tasks`` independent copies of a single-task step with ``jax.vmap``.

    Every per-task output gains a leading ``num_tasks`` axis; host data from
    ``get_batch(steps)`` is shaped ``[steps, num_tasks, ...]``.
    """

    def __init__(self, truncated_step: TruncatedStep, num_tasks: int):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.truncated_step = truncated_step
        self.num_tasks = int(num_tasks)

    def outer_init(self, key):
        return self.truncated_step.outer_init(key)

    def init_step_state(self, theta, outer_state, key, theta_is_vector=False):
        return self._init(
            self.truncated_step.init_step_state, theta, outer_state, key, theta_is_vector
        )

    def init_episode_state(self, theta, outer_state, key, theta_is_vector=False):
        return self._init(
            self.truncated_step.init_episode_state, theta, outer_state, key, theta_is_vector
        )

    def _init(self, init_one, theta, outer_state, key, theta_is_vector):
        keys = jax.random.split(key, self.num_tasks)
        init = jax.vmap(init_one, in_axes=(0 if theta_is_vector else None, None, 0))
        return init(theta, outer_state, keys)

    def unroll_step(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        keys = jax.random.split(key, self.num_tasks)
        step = jax.vmap(
            self.truncated_step.unroll_step,
            in_axes=(0 if theta_is_vector else None, 0, 0, 0, None),
        )
        return step(theta, unroll_state, keys, data, outer_state)

    def meta_loss_batch(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        keys = jax.random.split(key, self.num_tasks)
        meta_loss = jax.vmap(
            self.truncated_step.meta_loss_batch,
            in_axes=(0 if theta_is_vector else None, 0, 0, 0, None),
        )
        return meta_loss(theta, unroll_state, keys, data, outer_state)

    def _vectorized(self, batches: list[Any], steps: int | None) -> Any:
        if all(b is None for b in batches):
            return None
        return _stack(batches, axis=0 if steps is None else 1)

    def get_batch(self, steps=None):
        return self._vectorized(
            [self.truncated_step.get_batch(steps) for _ in range(self.num_tasks)], steps
        )

    def get_outer_batch(self, steps=None):
        return self._vectorized(
            [self.truncated_step.get_outer_batch(steps) for _ in range(self.num_tasks)], steps
        )

    def task_name(self):
        return self.truncated_step.task_name()
