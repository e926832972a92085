"""Gradient-estimator protocol and the antithetic unroll that ES-family estimators share.

Every estimator exposes a pure ``estimate(theta, state, key, data, outer_state)``
(jittable, vmappable over seeds) and a convenience
``compute_gradient_estimate(theta, state, key)`` that fetches host data, if the
truncated step has any, and calls the jitted ``estimate`` with the worker state
donated. A whole truncation is one jitted call: a ``lax.scan`` over its steps
with the antithetic members run as one vmapped batch.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.tree_utils import select_tasks
from popmeta.core.truncated_step import TruncatedStep

__all__ = ["EstimatorOut", "GradientEstimator", "PerturbedUnroll", "perturbed_unroll"]

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

    @functools.cached_property
    def _jitted_estimate(self):
        return jax.jit(self.estimate, donate_argnums=(1,))

    @functools.cached_property
    def jitted_init_worker_state(self):
        return jax.jit(self.init_worker_state)

    def compute_gradient_estimate(
        self, theta: PyTree, state: Any, key: jax.Array, outer_state: Any = None
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """One estimate; ``state`` is donated and must not be used afterwards."""
        data = self.truncated_step.get_batch(self.trunc_length)
        return self._jitted_estimate(theta, state, key, data, outer_state)


def delta_loss_transform(
    delta: jax.Array, sign_delta_loss_scalar: float | None, clip_loss_diff: float | None
) -> jax.Array:
    """Optional robustness transforms of the antithetic loss difference."""
    if clip_loss_diff is not None:
        delta = jnp.clip(delta, -clip_loss_diff, clip_loss_diff)
    if sign_delta_loss_scalar is not None:
        delta = jnp.sign(delta) * sign_delta_loss_scalar
    return delta


def sample_perturbation(key: jax.Array, theta: PyTree, num_tasks: int, std: float) -> PyTree:
    """Gaussian noise of std ``std`` with theta's structure and a leading task axis."""
    leaves, treedef = jax.tree_util.tree_flatten(theta)
    keys = jax.random.split(key, len(leaves))
    noise = [
        std * jax.random.normal(k, (num_tasks, *jnp.shape(x)), jnp.result_type(x))
        for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noise)


def weighted_task_mean(per_task_grad: PyTree, valid: jax.Array) -> PyTree:
    """Mean over the tasks that had at least one valid step."""
    scale = valid.astype(jnp.float32) / jnp.maximum(valid.sum(), 1)
    return jax.tree_util.tree_map(
        lambda g: jnp.tensordot(scale.astype(g.dtype), g, axes=1), per_task_grad
    )


class PerturbedUnroll(NamedTuple):
    """Result of unrolling several perturbed members through one truncation.

    Attributes:
      state: member states after the truncation, leading axis = member.
      losses: ``[steps, members, tasks]`` per-step losses.
      mask: ``[steps, tasks]`` valid steps (valid in every member).
      is_done: ``[steps, tasks]`` steps that ended a trajectory.
      in_first: ``[steps, tasks]`` steps that belong to the trajectory that was
        running when the truncation began (the ``is_done`` step included).
    """

    state: Any
    losses: jax.Array
    mask: jax.Array
    is_done: jax.Array
    in_first: jax.Array


def perturbed_unroll(
    truncated_step: TruncatedStep,
    theta: PyTree,
    signs: tuple[float, ...],
    noise_first: PyTree,
    noise_after: PyTree,
    member_states: Any,
    starts_with_reset: jax.Array,
    key: jax.Array,
    data: Any,
    num_steps: int,
    outer_state: Any,
) -> PerturbedUnroll:
    """Unrolls members ``theta + sign * noise`` for ``num_steps`` steps in one scan.

    All members see the same keys and the same data. ``noise_first`` perturbs the
    trajectory that is running when the truncation begins; ``noise_after`` the
    trajectories that start inside it (they are the same array for estimators
    that draw one noise per truncation).
    """
    signs_arr = jnp.asarray(signs, jnp.float32)
    keys = jax.random.split(key, num_steps)
    unroll = jax.vmap(
        functools.partial(truncated_step.unroll_step, theta_is_vector=True),
        in_axes=(0, 0, None, None, None),
    )

    def member_thetas(noise):
        def leaf(t, n):
            s = signs_arr.reshape((-1,) + (1,) * n.ndim).astype(n.dtype)
            return t[None, None] + s * n[None]

        return jax.tree_util.tree_map(leaf, theta, noise)

    def body(carry, xs):
        states, in_first = carry
        step_key, step_data = xs
        noise = (
            noise_first
            if noise_first is noise_after
            else select_tasks(in_first, noise_first, noise_after)
        )
        states, out = unroll(member_thetas(noise), states, step_key, step_data, outer_state)
        is_done = out.is_done[0]
        mask = jnp.all(out.mask, axis=0)
        return (states, in_first & ~is_done), (out.loss, mask, is_done, in_first)

    (states, _), (losses, mask, is_done, in_first) = jax.lax.scan(
        body, (member_states, ~starts_with_reset), (keys, data), length=num_steps
    )
    return PerturbedUnroll(states, losses, mask, is_done, in_first)


class AntitheticDeltas(NamedTuple):
    """Per-task antithetic loss differences split by trajectory."""

    first: jax.Array  # from steps of the trajectory running at the start
    after: jax.Array  # from steps of trajectories that began inside the truncation
    mean_loss: jax.Array  # per task, mean of the + and - members
    valid: jax.Array  # per task: at least one valid step


def antithetic_deltas(
    unrolled: PerturbedUnroll,
    sign_delta_loss_scalar: float | None = None,
    clip_loss_diff: float | None = None,
) -> AntitheticDeltas:
    """Masked-mean loss differences L(theta+eps) - L(theta-eps), split by trajectory.

    Members 0 and 1 must be the + and - members.
    """
    mask = unrolled.mask.astype(jnp.float32)
    count = mask.sum(axis=0)
    denom = jnp.maximum(count, 1.0)
    diff = (unrolled.losses[:, 0] - unrolled.losses[:, 1]) * mask
    in_first = unrolled.in_first.astype(jnp.float32)
    first = (diff * in_first).sum(axis=0) / denom
    after = (diff * (1.0 - in_first)).sum(axis=0) / denom
    mean_loss = ((unrolled.losses[:, 0] + unrolled.losses[:, 1]) * 0.5 * mask).sum(axis=0) / denom
    return AntitheticDeltas(
        first=delta_loss_transform(first, sign_delta_loss_scalar, clip_loss_diff),
        after=delta_loss_transform(after, sign_delta_loss_scalar, clip_loss_diff),
        mean_loss=mean_loss,
        valid=count > 0,
    )


def es_metrics(deltas: AntitheticDeltas, unrolled: PerturbedUnroll) -> dict[str, jax.Array]:
    return {
        "mean_loss": task_mean(deltas.mean_loss, deltas.valid),
        "abs_delta_loss": task_mean(jnp.abs(deltas.first + deltas.after), deltas.valid),
        "num_done": unrolled.is_done.sum(),
        "valid_steps": unrolled.mask.sum(),
    }


def task_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    return (x * valid).sum() / jnp.maximum(valid.sum(), 1)


def ends_with_reset(unrolled: PerturbedUnroll) -> jax.Array:
    """Tasks whose last step ended a trajectory: the next truncation starts with a reset."""
    return unrolled.is_done[-1]
