"""Small pytree helpers: per-task (leading-axis) arithmetic, and NamedTuple ``replace``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def _broadcast_to(x: jax.Array, leaf: jax.Array) -> jax.Array:
    return x.reshape(x.shape + (1,) * (leaf.ndim - x.ndim))


def select_tasks(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Per-task ``where`` over pytrees whose leaves lead with the task axis."""
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(_broadcast_to(pred, a), a, b), on_true, on_false
    )


def per_task(scale: jax.Array, tree: PyTree) -> PyTree:
    """Scales each task's slice of ``tree`` (leading axis) by ``scale[task]``."""
    return jax.tree_util.tree_map(lambda t: _broadcast_to(scale, t).astype(t.dtype) * t, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree_util.tree_map(jnp.add, a, b)


def tree_zeros_like(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


def stack_members(tree: PyTree, num_members: int) -> PyTree:
    """Copies ``tree`` along a new leading member axis."""
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * num_members), tree)


def replace(self: Any, **fields: Any) -> Any:
    """A copy of the NamedTuple ``self`` with ``fields`` replaced.

    State NamedTuples bind this as their ``replace`` method, so that code written
    for learned_optimization's ``flax.struct.dataclass`` states, such as
    ``opt_state.replace(iteration=0)``, runs unchanged.

    Raises:
      ValueError: if a name in ``fields`` is not a field of ``self``.
    """
    return self._replace(**fields)
