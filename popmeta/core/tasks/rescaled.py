"""Task augmentation by reparameterization: the same problem at random parameter scales.

:class:`RescaledFamily` wraps any task family. Each sampled task draws one
factor per parameter tensor and one for the whole task, each log-uniform in
its range, and multiplies them into a scale ``s`` per tensor. The wrapped task
optimizes ``q = p / s``: its loss is ``L(q * s)``, its initial point ``p0 / s``,
so it starts at the original loss, but every tensor's parameters are ``1 / s``
times and its gradients ``s`` times the original's. A learned optimizer
meta-trained on such tasks sees many gradient and parameter scales for one
underlying problem, the augmentation Celo (2025) and Celo2 (ICLR 2026) credit
for their rules' stability on much larger tasks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from popmeta.core.tasks.base import Batch, Params, Task, TaskFamily, TaskParams

__all__ = ["NO_RESCALING", "RescaledFamily", "RescaledTaskParams", "ScaleRange"]


class ScaleRange(NamedTuple):
    """Factors drawn log-uniformly in ``[low, high]`` (``(1, 1)``: no rescaling)."""

    low: float = 1.0
    high: float = 1.0


NO_RESCALING = ScaleRange()


class RescaledTaskParams(NamedTuple):
    """The wrapped family's task parameter and the scale of each parameter tensor.

    Attributes:
      inner: the wrapped family's task parameter.
      scales: ``[num_tensors]`` float32, in the order of the params' leaves;
        drawn once per task, so a loss evaluation draws no random numbers.
    """

    inner: TaskParams
    scales: jax.Array


def _log_uniform(key: jax.Array, scale_range: ScaleRange, shape: tuple[int, ...] = ()) -> jax.Array:
    low, high = jnp.log(jnp.float32(scale_range.low)), jnp.log(jnp.float32(scale_range.high))
    return jnp.exp(jax.random.uniform(key, shape, jnp.float32, low, high))


class _RescaledTask(Task):
    def __init__(self, task: Task, scales: jax.Array):
        self._task = task
        self._scales = scales
        self.datasets = task.datasets

    def scales(self, params: Params) -> Params:
        """The scale ``s`` of each tensor of ``params`` (a params-shaped tree of scalars)."""
        return jax.tree_util.tree_structure(params).unflatten(list(self._scales))

    def original(self, params: Params) -> Params:
        """The original task's parameters ``q * s`` of this task's ``params`` ``q``."""
        scales = self.scales(params)
        return jax.tree.map(lambda q, s: q * s.astype(q.dtype), params, scales)

    def init(self, key: jax.Array) -> Params:
        params = self._task.init(key)
        scales = self.scales(params)
        return jax.tree.map(lambda p, s: p / s.astype(p.dtype), params, scales)

    def loss(self, params: Params, key: jax.Array, data: Batch) -> jax.Array:
        return self._task.loss(self.original(params), key, data)

    def normalizer(self, loss: jax.Array) -> jax.Array:
        return self._task.normalizer(loss)

    def accuracy(self, params: Params, data: Batch) -> jax.Array | None:
        return self._task.accuracy(self.original(params), data)

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch | None:
        return self._task.sample_batch(key, split)

    @property
    def name(self) -> str:
        return f"Rescaled({self._task.name})"


class RescaledFamily(TaskFamily):
    """``family`` with every task's parameters rescaled (see the module docstring).

    Args:
      family: the family to augment; its data, batches and meta-loss scale are kept.
      per_tensor: range of the factor drawn for each parameter tensor.
      overall: range of the factor drawn once per task, for all its tensors.
    """

    def __init__(
        self,
        family: TaskFamily,
        per_tensor: ScaleRange = NO_RESCALING,
        overall: ScaleRange = NO_RESCALING,
    ):
        for label, scale_range in (("per_tensor", per_tensor), ("overall", overall)):
            if not 0 < scale_range.low <= scale_range.high:
                raise ValueError(f"{label}: need 0 < low <= high, got {tuple(scale_range)}")
        self.family = family
        self.per_tensor = ScaleRange(*map(float, per_tensor))
        self.overall = ScaleRange(*map(float, overall))
        self.datasets = family.datasets

    def sample(self, key: jax.Array) -> RescaledTaskParams:
        key_inner, key_overall, key_tensors = jax.random.split(key, 3)
        inner = self.family.sample(key_inner)
        shapes = jax.eval_shape(self.family.task_fn(inner).init, key_inner)
        num_tensors = len(jax.tree_util.tree_leaves(shapes))
        overall = _log_uniform(key_overall, self.overall)
        per_tensor = _log_uniform(key_tensors, self.per_tensor, (num_tensors,))
        return RescaledTaskParams(inner, overall * per_tensor)

    def task_fn(self, task_params: RescaledTaskParams) -> _RescaledTask:
        return _RescaledTask(self.family.task_fn(task_params.inner), task_params.scales)

    def sample_batch(self, key: jax.Array, split: str = "train") -> Batch | None:
        return self.family.sample_batch(key, split)

    @property
    def name(self) -> str:
        return f"Rescaled({self.family.name})"
