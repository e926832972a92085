"""The antithetic unroll shared by the ES-family estimators (FullES, TruncatedES, PES, NRES).

The + and - members (and TruncatedES's unperturbed third member) run as one
vmapped batch inside one ``lax.scan`` over the truncation's steps; they see the
same keys and the same data. Loss differences are split by trajectory: steps of
the trajectory running when the truncation began, and steps of trajectories
that began inside it, which is what PES and NRES need to stay unbiased across
resets.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.estimators.base import GradientEstimator, family_loss_metrics, task_mean
from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.core.tree_utils import select_tasks
from popmeta.core.truncated_step import TruncatedStep

__all__ = [
    "AntitheticDeltas",
    "AntitheticEstimator",
    "PerturbedUnroll",
    "antithetic_deltas",
    "perturbed_unroll",
]

PyTree = Any


class AntitheticEstimator(GradientEstimator):
    """Shared configuration and gradient formula of the antithetic ES estimators.

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

    def _noise(self, key: jax.Array, theta: PyTree) -> PyTree:
        return sample_perturbation(key, theta, self.truncated_step.num_tasks, self.std)

    def _unroll(
        self,
        theta: PyTree,
        signs: tuple[float, ...],
        noise_first: PyTree,
        noise_after: PyTree,
        member_states: Any,
        starts_with_reset: jax.Array,
        key: jax.Array,
        data: Any,
        outer_state: Any,
    ) -> tuple[PerturbedUnroll, AntitheticDeltas]:
        unrolled = perturbed_unroll(
            self.truncated_step,
            theta,
            signs,
            noise_first,
            noise_after,
            member_states,
            starts_with_reset,
            key,
            data,
            self.trunc_length,
            outer_state,
        )
        deltas = antithetic_deltas(unrolled, self.sign_delta_loss_scalar, self.clip_loss_diff)
        return unrolled, deltas

    def _output(
        self,
        per_task_grad: PyTree,
        deltas: AntitheticDeltas,
        unrolled: PerturbedUnroll,
        new_state: Any,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Mean over valid tasks of ``per_task_grad / (2 std^2)``, with the metrics."""
        grad = jax.tree_util.tree_map(
            lambda g: g / (2 * self.std**2), weighted_task_mean(per_task_grad, deltas.valid)
        )
        metrics = es_metrics(deltas, unrolled)
        metrics |= family_loss_metrics(self.truncated_step, deltas.mean_loss, deltas.valid)
        return EstimatorOut(grad, metrics["mean_loss"], deltas.valid.sum(), new_state), metrics


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
        states, out = truncated_step.unroll_members(
            member_thetas(noise), states, step_key, step_data, outer_state
        )
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


def ends_with_reset(unrolled: PerturbedUnroll) -> jax.Array:
    """Tasks whose last step ended a trajectory: the next truncation starts with a reset."""
    return unrolled.is_done[-1]
