"""Task and TaskFamily: the inner problems a learned optimizer is trained on.

Names and semantics follow ``learned_optimization.tasks.base``. One addition:
``sample_batch(key, split)``, a jittable on-device sampler. Small datasets are
held on the accelerator and batches are drawn inside the jitted unroll from a
PRNG key; the host ``datasets`` iterators remain for compatibility.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.tasks.datasets import Batch, Datasets

Params = Any
TaskParams = Any

__all__ = [
    "Batch",
    "Datasets",
    "Params",
    "Task",
    "TaskFamily",
    "TaskParams",
    "single_task_to_family",
    "vec_get_batch",
]


class Task:
    """A single inner problem: an initializer and a loss.

    Attributes:
      datasets: Host-side :class:`Datasets`, or None for data-free tasks.
    """

    datasets: Datasets | None = None

    def init(self, key: jax.Array) -> Params:
        """Samples initial parameters (a pytree)."""
        raise NotImplementedError

    def loss(self, params: Params, key: jax.Array, data: Batch) -> jax.Array:
        """Returns the scalar loss of ``params`` on one batch ``data``."""
        raise NotImplementedError

    def normalizer(self, loss: jax.Array) -> jax.Array:
        """Maps a loss to the scale used as a meta-loss (identity by default)."""
        return loss

    def accuracy(self, params: Params, data: Batch) -> jax.Array | None:
        """Fraction of ``data`` that ``params`` classifies correctly; None for tasks without labels.

        Meta-testing reports it beside the test loss where a task defines it.
        """
        del params, data
        return None

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch | None:
        """Draws one batch of ``split`` on device from ``key``; jittable.

        ``split`` is static (a python string). Data-free tasks return None,
        which is an empty pytree, so callers can vmap over keys regardless.
        """
        del key, split
        return None

    @property
    def name(self) -> str:
        return type(self).__name__


class TaskFamily:
    """A distribution over tasks, indexed by an array-valued ``task_param``.

    ``sample`` and ``task_fn`` are pure so a population of tasks can be built
    with ``jax.vmap(family.sample)(keys)`` and ``task_fn`` applied to a traced
    ``task_param`` inside jit / vmap. All tasks of a family share its data.

    Attributes:
      datasets: Host-side :class:`Datasets`, or None for data-free families.
    """

    datasets: Datasets | None = None

    def sample(self, key: jax.Array) -> TaskParams:
        """Samples a task parameter (pytree of arrays); jittable, vmappable."""
        raise NotImplementedError

    def task_fn(self, task_params: TaskParams) -> Task:
        """Returns the task of ``task_params`` (which may be a tracer)."""
        raise NotImplementedError

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch | None:
        """Draws one batch on device from the family's shared data; jittable.

        Returns None for data-free families.
        """
        del key, split
        return None

    @property
    def name(self) -> str:
        return type(self).__name__


class _SingleTaskFamily(TaskFamily):
    """Family with exactly one member; ``task_param`` is a dummy scalar."""

    def __init__(self, task: Task):
        self.task = task
        self.datasets = task.datasets

    def sample(self, key: jax.Array) -> jax.Array:
        del key
        # A real (if meaningless) array keeps vmap / tree code uniform.
        return jnp.zeros((), jnp.int32)

    def task_fn(self, task_params: TaskParams) -> Task:
        del task_params
        return self.task

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch | None:
        return self.task.sample_batch(key, split)

    @property
    def name(self) -> str:
        return self.task.name


def single_task_to_family(task: Task) -> TaskFamily:
    """Wraps ``task`` as a :class:`TaskFamily` that always returns it.

    Args:
      task: The task.

    Returns:
      A family sharing ``task``'s datasets, on-device sampler and name, whose
      ``task_param`` is a dummy int32 scalar.
    """
    return _SingleTaskFamily(task)


def vec_get_batch(
    task_family: TaskFamily | Task,
    n_tasks: int,
    split: str = "train",
    numpy: bool = False,
) -> Any:
    """Stacks ``n_tasks`` host batches along a new leading axis.

    Host-side counterpart of ``jax.vmap(family.sample_batch)(keys)``, as in
    learned_optimization.

    Args:
      task_family: Anything with a ``datasets`` attribute.
      n_tasks: Number of batches to draw (one per task).
      split: Which split's iterator to draw from.
      numpy: Return numpy arrays instead of jax arrays.

    Returns:
      The stacked pytree, or ``()`` when ``datasets`` is None.
    """
    if task_family.datasets is None:
        return ()
    it = task_family.datasets.split(split)
    batches = [next(it) for _ in range(n_tasks)]
    stack = np.stack if numpy else jnp.stack
    return jax.tree.map(lambda *xs: stack(xs), *batches)
