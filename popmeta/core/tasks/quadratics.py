"""Quadratic tasks and task families: cheap inner problems for tests and demos.

Family variant used here (documented because it differs from a plain
``sum((scale * p) ** 2)``): each task is a diagonal quadratic

    L(p) = 1/2 * sum_i s_i * p_i**2,    s_i ~ LogUniform(min_scale, max_scale)

so ``task_param = s`` *is* the per-coordinate curvature. With the default
range [0.1, 10] the condition number is at most 100, and a single learning rate
below 2 / max(s) = 0.2 is stable on every member: hard enough that step-size
adaptation pays off, well-conditioned enough that short unrolls make progress.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.core.tasks.base import Task, TaskFamily
from popmeta.core.tasks.datasets import Batch, Datasets, InMemoryDataset

__all__ = [
    "FixedDimQuadraticFamily",
    "FixedDimQuadraticFamilyData",
    "QuadraticTask",
]


class QuadraticTask(Task):
    """``loss(p) = sum(p**2)`` with ``p ~ N(0, I)`` of shape ``[dim]``; data-free."""

    def __init__(self, dim: int = 10):
        self.dim = dim

    def init(self, key: jax.Array) -> jax.Array:
        return jax.random.normal(key, (self.dim,), jnp.float32)

    def loss(self, params: jax.Array, key: jax.Array, data: Batch) -> jax.Array:
        del key, data
        return jnp.sum(jnp.square(params))


def _sample_log_uniform_scale(
    key: jax.Array, dim: int, min_scale: float, max_scale: float
) -> jax.Array:
    log_s = jax.random.uniform(
        key, (dim,), jnp.float32, minval=np.log(min_scale), maxval=np.log(max_scale)
    )
    return jnp.exp(log_s)


class _ScaledQuadraticTask(Task):
    """One member of :class:`FixedDimQuadraticFamily`; ``scale`` may be traced."""

    def __init__(self, scale: jax.Array, dim: int):
        self.scale = scale
        self.dim = dim

    def init(self, key: jax.Array) -> jax.Array:
        return jax.random.normal(key, (self.dim,), jnp.float32)

    def loss(self, params: jax.Array, key: jax.Array, data: Batch) -> jax.Array:
        del key, data
        return 0.5 * jnp.sum(self.scale * jnp.square(params))


class FixedDimQuadraticFamily(TaskFamily):
    """Diagonal quadratics with log-uniform per-coordinate curvature; data-free.

    ``task_param`` is the curvature vector ``s`` of shape ``[dim]`` and the task
    loss is ``0.5 * sum(s * p**2)`` (see the module docstring for why).
    Parameters are initialised ``N(0, I)``.
    """

    def __init__(self, dim: int = 10, min_scale: float = 0.1, max_scale: float = 10.0):
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"Need 0 < min_scale <= max_scale; got {min_scale}, {max_scale}.")
        self.dim = dim
        self.min_scale = min_scale
        self.max_scale = max_scale

    def sample(self, key: jax.Array) -> jax.Array:
        return _sample_log_uniform_scale(key, self.dim, self.min_scale, self.max_scale)

    def task_fn(self, task_params: jax.Array) -> Task:
        return _ScaledQuadraticTask(task_params, self.dim)


class _NoisyScaledQuadraticTask(Task):
    """One member of :class:`FixedDimQuadraticFamilyData`."""

    def __init__(self, family: FixedDimQuadraticFamilyData, scale: jax.Array):
        self._family = family
        self.scale = scale
        self.dim = family.dim
        self.datasets = family.datasets

    def init(self, key: jax.Array) -> jax.Array:
        return jax.random.normal(key, (self.dim,), jnp.float32)

    def loss(self, params: jax.Array, key: jax.Array, data: jax.Array) -> jax.Array:
        del key
        per_example = 0.5 * jnp.sum(self.scale * jnp.square(params - data), axis=-1)
        return jnp.mean(per_example)

    def sample_batch(self, key: jax.Array, split: str = "train") -> jax.Array:
        return self._family.sample_batch(key, split)


class FixedDimQuadraticFamilyData(TaskFamily):
    """Stochastic diagonal quadratics: the optimum is observed through noisy data.

    Same task parameters as :class:`FixedDimQuadraticFamily`. A batch is an
    array ``x`` of shape ``[batch_size, dim]`` of i.i.d. ``N(0, noise_std**2)``
    samples, and

        loss(p, x) = mean_b 0.5 * sum_i s_i * (p_i - x_bi)**2,

    whose expectation is minimised at ``p = 0``; the gradient noise falls like
    ``noise_std / sqrt(batch_size)``. Each split is a fixed pool of
    ``num_examples`` samples drawn once from ``seed``, held on device (for the
    jittable :meth:`sample_batch`) and on the host (for :attr:`datasets`).
    """

    def __init__(
        self,
        dim: int = 10,
        batch_size: int = 8,
        noise_std: float = 0.5,
        num_examples: int = 1024,
        min_scale: float = 0.1,
        max_scale: float = 10.0,
        seed: int = 0,
    ):
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"Need 0 < min_scale <= max_scale; got {min_scale}, {max_scale}.")
        self.dim = dim
        self.batch_size = batch_size
        self.noise_std = noise_std
        self.min_scale = min_scale
        self.max_scale = max_scale
        rng = np.random.default_rng(seed)
        pools = {
            split: (noise_std * rng.standard_normal((num_examples, dim))).astype(np.float32)
            for split in ("train", "inner_valid", "outer_valid", "test")
        }
        self.data = InMemoryDataset(pools)
        self.datasets: Datasets = self.data.host_datasets(batch_size, seed=seed)

    def sample(self, key: jax.Array) -> jax.Array:
        return _sample_log_uniform_scale(key, self.dim, self.min_scale, self.max_scale)

    def task_fn(self, task_params: jax.Array) -> Task:
        return _NoisyScaledQuadraticTask(self, task_params)

    def sample_batch(self, key: jax.Array, split: str = "train") -> jax.Array:
        return self.data.sample_batch(key, self.batch_size, split)
