"""An estimator worker: one gradient estimator, its seed and its persistent state.

This is the unit of the population. The local engine runs workers in the
driver; the Ray engine wraps the same class in an actor, so both engines
compute bit-for-bit the same estimates for the same seeds.

A worker that sees several local devices (and ``population.shard_tasks``)
splits its tasks over them (:class:`~popmeta.core.estimators.TaskSharding`);
with one device it runs the plain jitted estimator, with no sharding machinery
at all. ``estimator.truncations_per_call`` > 1 averages several consecutive
truncations per call, in one jitted call.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from popmeta.config import Config
from popmeta.core.estimators import GradientEstimator, TaskSharding
from popmeta.experiment import build_estimator
from popmeta.estimate import Estimate

__all__ = ["EstimatorWorker", "worker_key"]


def worker_key(seed: int, rank: int, restart: int = 0) -> jax.Array:
    """Root key of worker ``rank``: independent of how many workers there are.

    A replacement worker (``restart`` > 0) gets fresh keys, so its inner
    problems restart at new random offsets.
    """
    key = jax.random.fold_in(jax.random.key(seed), rank + 1)
    return jax.random.fold_in(key, restart) if restart else key


def _task_sharding(config: Config, estimator: GradientEstimator) -> TaskSharding | None:
    """The sharding of the worker's tasks over its local devices, or None for one device."""
    devices = jax.local_devices()
    if not config.population.shard_tasks or len(devices) < 2:
        return None
    num_tasks = estimator.truncated_step.num_tasks
    if num_tasks % len(devices):
        raise ValueError(
            f"estimator.num_tasks ({num_tasks}) must be a multiple of the number of local "
            f"devices ({len(devices)}: {', '.join(str(d) for d in devices)}) to shard the "
            f"tasks over them; set estimator.num_tasks to a multiple of {len(devices)} or "
            "population.shard_tasks=false"
        )
    return TaskSharding(estimator, devices)


class EstimatorWorker:
    """Computes gradient estimates of theta with its own inner problems.

    Args:
      config: the run's config; the estimator and its truncated step are built from it.
      rank: the worker's index; with ``config.seed`` it fixes every key the worker uses.
      restart: how many times this rank has been replaced.

    Raises:
      ValueError: if the tasks are to be sharded over the local devices and
        ``estimator.num_tasks`` is not a multiple of their number.
    """

    def __init__(self, config: Config, rank: int, restart: int = 0):
        self.rank = rank
        self.estimator = build_estimator(config)
        self.truncations_per_call = config.estimator.truncations_per_call
        #: How tasks are split over local devices; None when the worker uses one device.
        self.sharding = _task_sharding(config, self.estimator)
        self._key = worker_key(config.seed, rank, restart)
        self._state: Any = None
        self._last_version: int | None = None
        self._repeats = 0

    def _call_key(self, version: int) -> jax.Array:
        """Key of the next call on theta ``version``; distinct for every call.

        The first call on a version uses ``fold_in(root, version + 1)``. In
        async mode an actor can be asked for several estimates of one version
        (queued calls, or a learner batch larger than the population); reusing
        the key would replay the same noise and data, so repeat ``r`` uses
        ``fold_in(fold_in(fold_in(root, version + 1), 0), r)`` (``fold_in(., k)``
        with ``k >= 1`` is taken by the truncations of one call). Versions
        arrive in nondecreasing order, so counting repeats of the last one suffices.
        """
        key = jax.random.fold_in(self._key, version + 1)
        if version == self._last_version:
            self._repeats += 1
            return jax.random.fold_in(jax.random.fold_in(key, 0), self._repeats)
        self._last_version, self._repeats = version, 0
        return key

    def compute(self, theta: Any, version: int) -> Estimate:
        """One estimate on ``theta`` (theta version ``version``).

        Covers ``truncations_per_call`` consecutive truncations; the metrics
        include ``compute_time_s``, the wall time of the call.
        """
        start = time.perf_counter()
        sharding = self.sharding
        if self._state is None:
            init = (
                self.estimator.jitted_init_worker_state
                if sharding is None
                else sharding.init_worker_state
            )
            self._state = init(theta, self._key)
        key = self._call_key(version)
        runner = self.estimator if sharding is None else sharding
        out, metrics = runner.compute_gradient_estimates(
            theta, self._state, key, self.truncations_per_call
        )
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
    def num_devices(self) -> int:
        """Devices the worker's tasks are spread over (1 when unsharded)."""
        return 1 if self.sharding is None else self.sharding.num_devices

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate, counting every task, antithetic member and truncation."""
        return (
            self.estimator.num_members
            * self.num_tasks
            * self.estimator.trunc_length
            * self.truncations_per_call
        )
