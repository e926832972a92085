"""Quadratic tasks and task families, as ``learned_optimization.tasks.quadratics`` defines them.

Each class here carries learned_optimization's name and computes what its
class of that name computes:

* :class:`QuadraticTask`: ``sum(p**2)``, ``p ~ N(0, I)``; data-free.
* :class:`FixedDimQuadraticFamily`: a target ``t ~ N(0, I)`` per task, loss
  ``sum((t - p)**2)``, ``p ~ N(0, I)``; data-free, identity normalizer.
* :class:`FixedDimQuadraticFamilyData`: the same sampled target, loss
  ``sum((t - p)**2) + x`` where the batch ``x`` is one scalar ``N(0, 1)``
  draw, and the normalizer clips the loss to ``[0, 1000]``.

Because the target is sampled per task, a task's optimum is not at the origin:
a learned optimizer cannot solve the family by stepping along ``-p``.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.tasks.base import Task, TaskFamily
from popmeta.core.tasks.datasets import SPLITS, Batch, Datasets

__all__ = [
    "CurvedQuadraticFamily",
    "FixedDimQuadraticFamily",
    "FixedDimQuadraticFamilyData",
    "QuadraticTask",
]

# learned_optimization clips FixedDimQuadraticFamilyData's meta-loss at this value.
_DATA_LOSS_CLIP = 1000.0


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be a positive integer; got {dim!r}.")
    return int(dim)


def _standard_normal(key: jax.Array, dim: int) -> jax.Array:
    """``N(0, I)`` of shape ``[dim]``: every start ``p`` here, and every sampled target."""
    return jax.random.normal(key, (dim,), jnp.float32)


class QuadraticTask(Task):
    """``loss(p) = sum(p**2)`` with ``p ~ N(0, I)`` of shape ``[dim]``; data-free."""

    def __init__(self, dim: int = 10):
        self.dim = _check_dim(dim)

    def init(self, key: jax.Array) -> jax.Array:
        return _standard_normal(key, self.dim)

    def loss(self, params: jax.Array, key: jax.Array, data: Batch) -> jax.Array:
        del key, data
        return jnp.sum(jnp.square(params))


class _TargetQuadraticTask(Task):
    """One member of :class:`FixedDimQuadraticFamily`; ``target`` may be traced."""

    def __init__(self, target: jax.Array, dim: int):
        self.target = target
        self.dim = dim

    def init(self, key: jax.Array) -> jax.Array:
        return _standard_normal(key, self.dim)

    def loss(self, params: jax.Array, key: jax.Array, data: Batch) -> jax.Array:
        del key, data
        return jnp.sum(jnp.square(self.target - params))


class FixedDimQuadraticFamily(TaskFamily):
    """Quadratics of a fixed dimension with a sampled target; data-free.

    ``task_param`` is the target ``t ~ N(0, I)`` of shape ``[dim]``; the task's
    loss is ``sum((t - p)**2)`` (minimised at ``p = t``) and its parameters
    start at ``p ~ N(0, I)``, as in learned_optimization.
    """

    def __init__(self, dim: int = 10):
        self.dim = _check_dim(dim)

    def sample(self, key: jax.Array) -> jax.Array:
        return _standard_normal(key, self.dim)

    def task_fn(self, task_params: jax.Array) -> Task:
        return _TargetQuadraticTask(task_params, self.dim)


class _CurvedQuadraticTask(_TargetQuadraticTask):
    """One member of :class:`CurvedQuadraticFamily`; its arrays may be traced."""

    def __init__(self, target: jax.Array, log_curvature: jax.Array, dim: int):
        super().__init__(target, dim)
        self.log_curvature = log_curvature

    def loss(self, params: jax.Array, key: jax.Array, data: Batch) -> jax.Array:
        del key, data
        return 0.5 * jnp.sum(jnp.exp(self.log_curvature) * jnp.square(params - self.target))


class CurvedQuadraticFamily(TaskFamily):
    """popmeta's own family: sampled targets *and* per-coordinate curvatures; data-free.

    Not a learned_optimization family. Each task draws a target ``t ~ N(0, I)`` and a
    curvature ``s_i ~ LogUniform(min_curvature, max_curvature)`` per
    coordinate (``task_param = (t, log s)``), and

        loss(p) = 0.5 * sum(s * (p - t)**2),    p ~ N(0, I) at the start.

    Why it exists: on :class:`FixedDimQuadraticFamily` every coordinate has the
    same curvature, so SGD at the one right learning rate solves a task in a
    single step and nothing can beat it. Here no single learning rate suits
    every coordinate (a condition number of up to ``max / min``, 100 by
    default, within each task), stepping along ``-p`` leads nowhere (the
    optimum is the sampled target), and an optimizer that adapts per
    coordinate and to the horizon has a real lead to learn.
    """

    def __init__(self, dim: int = 10, min_curvature: float = 0.1, max_curvature: float = 10.0):
        if not 0 < min_curvature <= max_curvature:
            raise ValueError(
                f"need 0 < min_curvature <= max_curvature; got {min_curvature}, {max_curvature}"
            )
        self.dim = _check_dim(dim)
        self.log_range = (float(np.log(min_curvature)), float(np.log(max_curvature)))

    def sample(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        key_target, key_curvature = jax.random.split(key)
        low, high = self.log_range
        log_curvature = jax.random.uniform(
            key_curvature, (self.dim,), jnp.float32, minval=low, maxval=high
        )
        return _standard_normal(key_target, self.dim), log_curvature

    def task_fn(self, task_params: tuple[jax.Array, jax.Array]) -> Task:
        target, log_curvature = task_params
        return _CurvedQuadraticTask(target, log_curvature, self.dim)


class _NoisyTargetQuadraticTask(_TargetQuadraticTask):
    """One member of :class:`FixedDimQuadraticFamilyData`."""

    def __init__(self, family: FixedDimQuadraticFamilyData, target: jax.Array):
        super().__init__(target, family.dim)
        self._family = family
        self.datasets = family.datasets

    def loss(self, params: jax.Array, key: jax.Array, data: jax.Array) -> jax.Array:
        del key
        return jnp.sum(jnp.square(self.target - params)) + data

    def normalizer(self, loss: jax.Array) -> jax.Array:
        return jnp.clip(loss, 0.0, _DATA_LOSS_CLIP)

    def sample_batch(self, key: jax.Array, split: str = "train") -> jax.Array:
        return self._family.sample_batch(key, split)


def _noise_iterator(seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    while True:
        yield np.asarray(rng.standard_normal(), np.float32)


class FixedDimQuadraticFamilyData(TaskFamily):
    """Sampled-target quadratics whose loss carries additive noise from the data.

    ``task_param`` is the target ``t ~ N(0, I)`` of shape ``[dim]``. A batch is
    one float32 scalar ``x ~ N(0, 1)`` (every split draws from the same
    distribution), and

        loss(p, x) = sum((t - p)**2) + x,    normalizer(l) = clip(l, 0, 1000).

    The noise shifts the loss but not its gradient, so the inner optimizer sees
    exact gradients while the meta-loss is noisy; that is
    learned_optimization's definition. The on-device :meth:`sample_batch` draws ``x`` from
    its key (a pure function of it, so antithetic members share it); the host
    :attr:`datasets` are infinite numpy iterators seeded from ``seed`` (split
    ``i`` of :data:`SPLITS` uses ``seed + i``), where learned_optimization's
    are unseeded.
    """

    def __init__(self, dim: int = 10, seed: int = 0):
        self.dim = _check_dim(dim)
        self.datasets: Datasets = Datasets(
            **{split: _noise_iterator(seed + i) for i, split in enumerate(SPLITS)},
            abstract_batch=jax.ShapeDtypeStruct((), jnp.float32),
        )

    def sample(self, key: jax.Array) -> jax.Array:
        return _standard_normal(key, self.dim)

    def task_fn(self, task_params: jax.Array) -> Task:
        return _NoisyTargetQuadraticTask(self, task_params)

    def sample_batch(self, key: jax.Array, split: str = "train") -> jax.Array:
        if split not in SPLITS:
            raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
        return jax.random.normal(key, (), jnp.float32)
