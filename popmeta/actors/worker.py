"""An estimator worker: one gradient estimator, its seed and its persistent state.

This is the unit of the population. The local engine runs workers in the
driver; the Ray engine wraps the same class in an actor, so both engines
compute bit-for-bit the same estimates for the same seeds.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from popmeta.config import Config
from popmeta.experiment import build_estimator
from popmeta.learner.aggregation import Estimate

__all__ = ["EstimatorWorker", "worker_key"]


def worker_key(seed: int, rank: int, restart: int = 0) -> jax.Array:
    """Root key of worker ``rank``: independent of how many workers there are.

    A replacement worker (``restart`` > 0) gets fresh keys, so its inner
    problems restart at new random offsets.
    """
    key = jax.random.fold_in(jax.random.key(seed), rank + 1)
    return jax.random.fold_in(key, restart) if restart else key


class EstimatorWorker:
    """Computes gradient estimates of theta with its own inner problems.

    Args:
      config: the run's config; the estimator and its truncated step are built from it.
      rank: the worker's index; with ``config.seed`` it fixes every key the worker uses.
      restart: how many times this rank has been replaced.
    """

    def __init__(self, config: Config, rank: int, restart: int = 0):
        self.rank = rank
        self.estimator = build_estimator(config)
        self._key = worker_key(config.seed, rank, restart)
        self._state: Any = None

    def compute(self, theta: Any, version: int) -> Estimate:
        """One estimate on ``theta`` (theta version ``version``)."""
        start = time.perf_counter()
        if self._state is None:
            self._state = self.estimator.jitted_init_worker_state(theta, self._key)
        key = jax.random.fold_in(self._key, version + 1)
        out, metrics = self.estimator.compute_gradient_estimate(theta, self._state, key)
        self._state = out.state
        grad = jax.tree_util.tree_map(np.asarray, out.grad)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["compute_time_s"] = time.perf_counter() - start
        return Estimate(grad, float(out.mean_loss), float(out.weight), version, self.rank, metrics)

    def trajectory_phases(self) -> np.ndarray:
        """Each task's position in its trajectory (iteration / length), or empty before the first call."""
        unroll_state = None if self._state is None else self.estimator.unroll_state(self._state)
        if unroll_state is None:
            return np.zeros((0,), np.float32)
        return np.asarray(self.estimator.truncated_step.trajectory_phase(unroll_state))

    @property
    def num_tasks(self) -> int:
        return self.estimator.truncated_step.num_tasks

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate, counting every task and antithetic member."""
        return self.estimator.num_members * self.num_tasks * self.estimator.trunc_length
