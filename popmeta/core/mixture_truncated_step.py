"""One worker's tasks drawn from several task families at once.

Tasks of different families have different parameter pytrees, so they cannot
share one vmapped batch. A :class:`MixtureTruncatedStep` holds one
:class:`~popmeta.core.lopt_truncated_step.VectorizedLOptTruncatedStep` per
*group* (a family, or one sampled architecture of a parametric family) and
gives each a fixed, contiguous block of the worker's task slots, so every
group compiles once and a truncation stays one ``lax.scan``. Per task it
behaves exactly like its groups side by side, so the estimators run on it
unchanged. :func:`apportion` splits the slots by the families' weights, the
same on every worker, so a checkpoint's worker states share one template.
How the groups' keys, thetas and outputs are combined: docs/design.md,
"Contracts".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.lopt_truncated_step import VectorizedLOptTruncatedStep
from popmeta.core.truncated_step import TruncatedStep, TruncatedUnrollOut

__all__ = ["MixtureTruncatedStep", "apportion"]


def apportion(weights: Sequence[float], num_tasks: int) -> tuple[int, ...]:
    """Splits ``num_tasks`` slots among families in proportion to ``weights``.

    Each family gets at least one slot; the rest follow the largest
    remainders of ``num_tasks * w / sum(w)`` (ties go to the earlier family).

    Args:
      weights: positive weights, one per family.
      num_tasks: slots to split; at least ``len(weights)``.

    Returns:
      The slot counts, in the order of ``weights``; they sum to ``num_tasks``.

    Raises:
      ValueError: on an empty or non-positive weight, or too few slots.
    """
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be a non-empty list of positive numbers; got {weights!r}")
    if num_tasks < w.size:
        raise ValueError(f"{w.size} families need at least {w.size} task slots; got {num_tasks}")
    target = num_tasks * w / w.sum()
    counts = np.maximum(np.floor(target).astype(np.int64), 1)
    while counts.sum() < num_tasks:
        counts[np.argmax(target - counts)] += 1
    while counts.sum() > num_tasks:
        # Only raising a family to its one slot can overshoot; take from the most over-served.
        over = np.where(counts > 1, counts - target, -np.inf)
        counts[np.argmax(over)] -= 1
    return tuple(int(c) for c in counts)


class MixtureTruncatedStep(TruncatedStep):
    """Groups of tasks from different families, trained side by side as one step.

    Args:
      groups: one vectorized step per group, all with the same learned
        optimizer; group ``g`` owns the next ``groups[g].num_tasks`` slots.
      family_names: the family of each group (groups may share one, e.g. the
        sampled architectures of a parametric family); the per-family
        meta-losses are reported under these names.

    Attributes:
      num_tasks: slots over all groups.
      family_names: the distinct families, in order of first appearance.
      family_of_task: int32 ``[num_tasks]``, each slot's index into ``family_names``.

    Raises:
      ValueError: on no groups, mismatched lengths, or a group that pulls host data.
    """

    def __init__(self, groups: Sequence[VectorizedLOptTruncatedStep], family_names: Sequence[str]):
        groups, family_names = list(groups), list(family_names)
        if not groups or len(groups) != len(family_names):
            raise ValueError(
                f"need one family name per group and at least one group; got {len(groups)} "
                f"groups and {len(family_names)} names"
            )
        if any(g.host_data for g in groups):
            raise ValueError("a mixture samples its data on device; no group may use host_data")
        self.groups = groups
        self.num_tasks = sum(g.num_tasks for g in groups)
        self.family_names = tuple(dict.fromkeys(family_names))
        self.family_of_task = np.concatenate(
            [
                np.full((g.num_tasks,), self.family_names.index(name), np.int32)
                for g, name in zip(groups, family_names, strict=True)
            ]
        )
        ends = np.cumsum([g.num_tasks for g in groups])
        self._blocks = [(int(e) - g.num_tasks, int(e)) for g, e in zip(groups, ends, strict=True)]

    def outer_init(self, key: jax.Array) -> Any:
        return self.groups[0].outer_init(key)

    def _slice(self, tree: Any, g: int, axis: int) -> Any:
        start, stop = self._blocks[g]
        return jax.tree_util.tree_map(
            lambda x: jax.lax.slice_in_dim(x, start, stop, axis=axis), tree
        )

    def _theta(self, theta: Any, g: int, theta_is_vector: bool) -> Any:
        return self._slice(theta, g, 0) if theta_is_vector else theta

    def _out(self, outs: list[TruncatedUnrollOut], axis: int) -> TruncatedUnrollOut:
        def cat(field: str) -> jax.Array:
            return jnp.concatenate([getattr(o, field) for o in outs], axis=axis)

        family = jnp.asarray(self.family_of_task)
        shape = outs[0].loss.shape[:axis] + family.shape
        return TruncatedUnrollOut(
            loss=cat("loss"),
            is_done=cat("is_done"),
            task_param=jnp.broadcast_to(family, shape),
            iteration=cat("iteration"),
            mask=cat("mask"),
        )

    @staticmethod
    def _check_no_data(data: Any) -> None:
        if data is not None:
            raise ValueError("a mixture samples its data on device; pass data=None")

    def _init_groups(self, method: str, theta, outer_state, key, theta_is_vector):
        return tuple(
            getattr(g, method)(
                self._theta(theta, i, theta_is_vector),
                outer_state,
                jax.random.fold_in(key, i),
                theta_is_vector,
            )
            for i, g in enumerate(self.groups)
        )

    def init_step_state(self, theta, outer_state, key, theta_is_vector=False):
        """The groups' states, each from ``fold_in(key, g)`` (random offsets included)."""
        return self._init_groups("init_step_state", theta, outer_state, key, theta_is_vector)

    def init_episode_state(self, theta, outer_state, key, theta_is_vector=False):
        """The groups' fresh-trajectory states, each from ``fold_in(key, g)``."""
        return self._init_groups("init_episode_state", theta, outer_state, key, theta_is_vector)

    def _joined(self, results: list[tuple[Any, TruncatedUnrollOut]], axis: int):
        """The groups' ``(state, out)`` pairs as one state tuple and one output."""
        states, outs = zip(*results, strict=True)
        return tuple(states), self._out(list(outs), axis)

    def _on_groups(self, method: str, theta, unroll_state, key, outer_state, theta_is_vector):
        """Each group's ``method`` on its theta and state, with ``fold_in(key, g)`` and no data."""
        return [
            getattr(g, method)(
                self._theta(theta, i, theta_is_vector),
                unroll_state[i],
                jax.random.fold_in(key, i),
                None,
                outer_state,
                theta_is_vector,
            )
            for i, g in enumerate(self.groups)
        ]

    def unroll_step(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        self._check_no_data(data)
        results = self._on_groups(
            "unroll_step", theta, unroll_state, key, outer_state, theta_is_vector
        )
        return self._joined(results, 0)

    def unroll_members(self, thetas, unroll_states, key, data, outer_state):
        # Thetas and states lead with the member axis; the task axis is 1.
        self._check_no_data(data)
        results = [
            g.unroll_members(
                self._slice(thetas, i, 1),
                unroll_states[i],
                jax.random.fold_in(key, i),
                None,
                outer_state,
            )
            for i, g in enumerate(self.groups)
        ]
        return self._joined(results, 1)

    def meta_loss_batch(self, theta, unroll_state, key, data, outer_state, theta_is_vector=False):
        self._check_no_data(data)
        return jnp.concatenate(
            self._on_groups(
                "meta_loss_batch", theta, unroll_state, key, outer_state, theta_is_vector
            )
        )

    def trajectory_phase(self, unroll_state: tuple[Any, ...]) -> jax.Array:
        """Each slot's position in its trajectory, in [0, 1], in slot order."""
        return jnp.concatenate(
            [g.trajectory_phase(s) for g, s in zip(self.groups, unroll_state, strict=True)]
        )

    def task_name(self) -> str:
        return "mixture(" + ",".join(self.family_names) + ")"
