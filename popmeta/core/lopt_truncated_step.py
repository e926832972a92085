"""Truncated step that trains sampled tasks with a learned optimizer.

``VectorizedLOptTruncatedStep`` keeps ``num_tasks`` inner problems side by side.
One unroll step is one inner update of every task. Each task counts its steps
in ``inner_step`` (the truncation counter); the step whose ``inner_step``
reaches the trajectory length reports ``is_done``; the next step resets that
task (new task sample, new parameters, a fresh optimizer state, ``inner_step``
0) and reports ``loss=0, mask=False, iteration=0``.

As in ``learned_optimization.outer_trainers.lopt_truncated_step``, the random
initial iteration offset moves only ``inner_step``: a task that starts at
offset k is a fresh task whose first trajectory is k steps shorter, and the
inner optimizer's own ``iteration`` counts the updates it really applied.
Resets run under one ``lax.cond`` for the whole batch, so the steps where no
task resets never pay for an init.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core import tree_utils
from popmeta.core.learned_optimizers.base import LearnedOptimizer
from popmeta.core.tasks.base import TaskFamily, vec_get_batch
from popmeta.core.tree_utils import select_tasks
from popmeta.core.truncated_step import TruncatedStep, TruncatedUnrollOut
from popmeta.core.truncation import TruncationSchedule, TruncationState

__all__ = [
    "META_LOSS_LOG_FLOOR",
    "META_LOSS_TRANSFORMS",
    "LOptTruncatedState",
    "VectorizedLOptTruncatedStep",
]

#: How each step's (normalized) meta-loss enters the sum the estimators differentiate.
META_LOSS_TRANSFORMS = ("identity", "log")
#: Added before the log: losses far below it all count about as much as zero.
META_LOSS_LOG_FLOOR = 1e-3


class LOptTruncatedState(NamedTuple):
    """Per-task state (every field has a leading ``num_tasks`` axis).

    The fields and their order are learned_optimization's ``TruncatedUnrollState``.

    Attributes:
      inner_opt_state: The inner optimizer's state (params, iteration, ...).
      inner_step: Steps taken on the current trajectory (int32), the counter the
        truncation schedule reads; starts at the random offset, or 0.
      truncation_state: The schedule's state (the trajectory's ``length``).
      task_param: The task being trained.
      is_done: The previous step ended the trajectory: this step resets it.
    """

    inner_opt_state: Any
    inner_step: jax.Array
    truncation_state: TruncationState
    task_param: Any
    is_done: jax.Array

    replace = tree_utils.replace


class VectorizedLOptTruncatedStep(TruncatedStep):
    """Inner training of ``num_tasks`` tasks from ``task_family`` by ``learned_opt``.

    Args:
      task_family: tasks to sample; one fresh sample per trajectory.
      learned_opt: the meta-learned optimizer; theta is its parameters.
      trunc_sched: trajectory lengths.
      num_tasks: number of inner problems trained side by side.
      random_initial_iteration_offset: if > 0, each task's first trajectory starts
        with ``inner_step`` drawn uniformly from ``[0, offset)`` (the inner
        optimizer still starts at iteration 0), so that the population's
        resets are spread out rather than in lockstep. Set it to the
        schedule's (maximum) length, as learned_optimization advises; an offset at or
        past a trajectory's length ends that trajectory on its first step.
        :meth:`init_episode_state` ignores it.
      meta_loss_split: None to use the normalized training loss before the update
        as the per-step meta-loss; otherwise a data split (e.g. "outer_valid") on
        which the updated parameters are evaluated.
      meta_loss_transform: ``"identity"`` sums the per-step losses as they are,
        so the first steps of a trajectory, whose losses are largest, dominate
        the meta-loss; ``"log"`` takes ``log(loss + META_LOSS_LOG_FLOOR)`` of
        each, so that halving the loss counts the same early and late in a run.
      host_data: if True, ``get_batch`` pulls host batches from the family's
        ``datasets`` iterators (learned_optimization's behaviour); by default data is
        sampled on device inside the jitted unroll and ``get_batch`` returns None.
    """

    def __init__(
        self,
        task_family: TaskFamily,
        learned_opt: LearnedOptimizer,
        trunc_sched: TruncationSchedule,
        num_tasks: int,
        random_initial_iteration_offset: int = 0,
        meta_loss_split: str | None = None,
        host_data: bool = False,
        meta_loss_transform: str = "identity",
    ):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if random_initial_iteration_offset < 0:
            raise ValueError(
                "random_initial_iteration_offset must be >= 0, got "
                f"{random_initial_iteration_offset}"
            )
        if meta_loss_transform not in META_LOSS_TRANSFORMS:
            raise ValueError(
                f"meta_loss_transform must be one of {META_LOSS_TRANSFORMS}; "
                f"got {meta_loss_transform!r}"
            )
        self.task_family = task_family
        self.learned_opt = learned_opt
        self.trunc_sched = trunc_sched
        self.num_tasks = int(num_tasks)
        self.random_initial_iteration_offset = int(random_initial_iteration_offset)
        self.meta_loss_split = meta_loss_split
        self.host_data = host_data
        self.meta_loss_transform = meta_loss_transform

    def outer_init(self, key: jax.Array) -> Any:
        """The learned optimizer's initial theta, as learned_optimization returns it."""
        return self.learned_opt.init(key)

    # -- one task -----------------------------------------------------------------

    def _init_one(self, theta, key, outer_state):
        """A fresh trajectory: inner step 0, optimizer at iteration 0."""
        key_task, key_params, key_opt, key_trunc = jax.random.split(key, 4)
        task_param = self.task_family.sample(key_task)
        task = self.task_family.task_fn(task_param)
        params = task.init(key_params)
        trunc_state = self.trunc_sched.init(key_trunc, outer_state)
        opt = self.learned_opt.opt_fn(theta, is_training=True)
        opt_state = opt.init(params, num_steps=trunc_state.length, key=key_opt)
        return LOptTruncatedState(
            inner_opt_state=opt_state,
            inner_step=jnp.asarray(0, jnp.int32),
            truncation_state=trunc_state,
            task_param=task_param,
            is_done=jnp.asarray(False),
        )

    def _update_one(self, theta, state: LOptTruncatedState, key, data, outer_state):
        key_data, key_loss, key_opt, key_trunc, key_meta = jax.random.split(key, 5)
        task = self.task_family.task_fn(state.task_param)
        opt = self.learned_opt.opt_fn(theta, is_training=True)
        if self.meta_loss_split is None:
            train_batch, meta_batch = data, None
        else:
            train_batch, meta_batch = data if data is not None else (None, None)
        if train_batch is None:
            train_batch = self.task_family.sample_batch(key_data, "train")
        params = opt.get_params(state.inner_opt_state)
        # The scopes name these parts in profiles (bench/profile_estimate.py).
        with jax.named_scope("task_loss_and_grad"):
            loss, grad = jax.value_and_grad(task.loss)(params, key_loss, train_batch)
        with jax.named_scope("learned_optimizer_update"):
            opt_state = opt.update(state.inner_opt_state, grad, loss=loss, key=key_opt)
        inner_step = state.inner_step + 1
        trunc_state, is_done = self.trunc_sched.next_state(
            state.truncation_state, inner_step, key_trunc, outer_state
        )
        if self.meta_loss_split is None:
            meta_loss = task.normalizer(loss)
        else:
            if meta_batch is None:
                meta_batch = self.task_family.sample_batch(key_meta, self.meta_loss_split)
            meta_loss = task.normalizer(task.loss(opt.get_params(opt_state), key_meta, meta_batch))
        if self.meta_loss_transform == "log":
            meta_loss = jnp.log(meta_loss + META_LOSS_LOG_FLOOR)
        out = TruncatedUnrollOut(
            loss=meta_loss.astype(jnp.float32),
            is_done=is_done,
            task_param=state.task_param,
            iteration=inner_step,
            mask=jnp.asarray(True),
        )
        return LOptTruncatedState(
            opt_state, inner_step, trunc_state, state.task_param, is_done
        ), out

    # -- vectorized ---------------------------------------------------------------

    def _theta_axis(self, theta_is_vector: bool) -> int | None:
        return 0 if theta_is_vector else None

    def init_step_state(self, theta, outer_state, key, theta_is_vector=False):
        """Fresh tasks, each at its random ``inner_step`` offset (see the class docstring)."""
        key_init, key_offset = jax.random.split(key)
        state = self.init_episode_state(theta, outer_state, key_init, theta_is_vector)
        if self.random_initial_iteration_offset:
            offsets = jax.random.randint(
                key_offset, (self.num_tasks,), 0, self.random_initial_iteration_offset, jnp.int32
            )
            state = state.replace(inner_step=offsets)
        return state

    def init_episode_state(self, theta, outer_state, key, theta_is_vector=False):
        """Fresh tasks at the start of their trajectories, with no random offset.

        Args:
          theta: meta-parameters (a leading task axis if ``theta_is_vector``).
          outer_state: passed to the truncation schedule.
          key: PRNG key.
          theta_is_vector: whether ``theta`` has a leading task axis.

        Returns:
          The state, every task at ``inner_step`` 0 and iteration 0.
        """
        init = jax.vmap(self._init_one, in_axes=(self._theta_axis(theta_is_vector), 0, None))
        return init(theta, jax.random.split(key, self.num_tasks), outer_state)

    def unroll_step(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        return self._unroll(
            theta, unroll_state, key, data, outer_state, self._theta_axis(theta_is_vector), False
        )

    def unroll_members(self, thetas, unroll_states, key, data, outer_state):
        # Not the default vmap over unroll_step: under it the reset predicate
        # would be batched and the cond would become a select that pays for a
        # fresh init at every step.
        return self._unroll(thetas, unroll_states, key, data, outer_state, 0, True)

    def _unroll(self, theta, unroll_state, key, data, outer_state, theta_axis, members):
        """One step of every task (of every member, if ``members``), resets under one cond."""

        def batched(fn, task_axes, member_axes):
            fn = jax.vmap(fn, in_axes=task_axes)
            return jax.vmap(fn, in_axes=member_axes) if members else fn

        key_update, key_reset = jax.random.split(key)
        update = batched(self._update_one, (theta_axis, 0, 0, 0, None), (0, 0, None, None, None))
        stepped, out = update(
            theta, unroll_state, jax.random.split(key_update, self.num_tasks), data, outer_state
        )
        resetting = unroll_state.is_done

        def reset_finished(stepped_and_out):
            stepped, out = stepped_and_out
            init = batched(self._init_one, (theta_axis, 0, None), (0, None, None))
            fresh = init(theta, jax.random.split(key_reset, self.num_tasks), outer_state)
            reset_out = TruncatedUnrollOut(
                loss=jnp.zeros_like(out.loss),
                is_done=jnp.zeros_like(out.is_done),
                task_param=fresh.task_param,
                iteration=jnp.zeros_like(out.iteration),
                mask=jnp.zeros_like(out.mask),
            )
            return select_tasks(resetting, fresh, stepped), select_tasks(resetting, reset_out, out)

        return jax.lax.cond(jnp.any(resetting), reset_finished, lambda so: so, (stepped, out))

    def meta_loss_batch(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        split = self.meta_loss_split or "train"

        def one(theta, state, key, batch):
            task = self.task_family.task_fn(state.task_param)
            opt = self.learned_opt.opt_fn(theta)
            if batch is None:
                batch = self.task_family.sample_batch(key, split)
            return task.normalizer(task.loss(opt.get_params(state.inner_opt_state), key, batch))

        keys = jax.random.split(key, self.num_tasks)
        return jax.vmap(one, in_axes=(self._theta_axis(theta_is_vector), 0, 0, 0))(
            theta, unroll_state, keys, data
        )

    def trajectory_phase(self, unroll_state: LOptTruncatedState) -> jax.Array:
        """Each task's position in its trajectory, ``inner_step / length``, in [0, 1].

        An offset at or past the length reads as 1 until the trajectory resets.
        """
        phase = unroll_state.inner_step / jnp.maximum(unroll_state.truncation_state.length, 1)
        return jnp.minimum(phase, 1.0)

    # -- host data (learned_optimization-compatible path) ----------------------

    def _host_batches(self, steps: int | None, split: str) -> Any:
        if not self.host_data or self.task_family.datasets is None:
            return None
        if steps is None:
            return vec_get_batch(self.task_family, self.num_tasks, split, numpy=True)
        batches = [
            vec_get_batch(self.task_family, self.num_tasks, split, numpy=True) for _ in range(steps)
        ]
        return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)

    def get_batch(self, steps=None):
        train = self._host_batches(steps, "train")
        if self.meta_loss_split is None or train is None:
            return train
        return train, self._host_batches(steps, self.meta_loss_split)

    def get_outer_batch(self, steps=None):
        return self._host_batches(steps, self.meta_loss_split or "train")

    def task_name(self):
        return getattr(self.task_family, "name", type(self.task_family).__name__)
