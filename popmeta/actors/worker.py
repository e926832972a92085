"""An estimator worker: one gradient estimator, its seed and its persistent state.

This is the unit of the population. The local engine runs workers in the
driver; the Ray engine wraps the same class in an actor, so both engines
compute bit-for-bit the same estimates for the same seeds.

The worker calls one :class:`~popmeta.core.estimators.EstimateRunner`: with
several local devices (and ``population.shard_tasks``) a
:class:`~popmeta.core.estimators.ShardedRunner` that splits its tasks over
them; with one device the estimator's plain jitted
:class:`~popmeta.core.estimators.SingleDeviceRunner`, with no sharding
machinery at all. ``estimator.truncations_per_call`` > 1 averages several
consecutive truncations per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.config import Config
from popmeta.core.estimators import EstimateRunner, GradientEstimator, make_runner
from popmeta.estimate import Estimate
from popmeta.experiment import build_estimator

__all__ = ["EstimatorWorker", "worker_key"]


def worker_key(seed: int, rank: int, restart: int = 0) -> jax.Array:
    """Root key of worker ``rank``: independent of how many workers there are.

    A replacement worker (``restart`` > 0) gets fresh keys, so its inner
    problems restart at new random offsets.
    """
    key = jax.random.fold_in(jax.random.key(seed), rank + 1)
    return jax.random.fold_in(key, restart) if restart else key


def _runner(config: Config, estimator: GradientEstimator) -> EstimateRunner:
    """The runner of the worker's estimator: sharded over the local devices when there are several.

    Args:
      config: the run's config; ``population.shard_tasks`` allows sharding.
      estimator: the worker's estimator.

    Returns:
      A ``ShardedRunner`` over ``jax.local_devices()`` when sharding is allowed
      and there are several, else the estimator's ``SingleDeviceRunner``.

    Raises:
      ValueError: if the tasks are to be sharded and do not split evenly over the devices.
    """
    devices = jax.local_devices() if config.population.shard_tasks else []
    try:
        return make_runner(estimator, devices)
    except ValueError as err:
        # ShardedRunner checks the split; this names the config fields that fix it.
        raise ValueError(
            f"estimator.num_tasks ({estimator.truncated_step.num_tasks}) cannot be sharded over "
            f"the local devices ({len(devices)}: {', '.join(str(d) for d in devices)}): {err}; "
            f"set estimator.num_tasks to a multiple of {len(devices)} or "
            "population.shard_tasks=false"
        ) from None


def _phases_fn(estimator: GradientEstimator, state: Any) -> Callable[[Any], jax.Array] | None:
    """A jitted ``state -> phases`` (float32, one per task), or None where there are none.

    There are none when the estimator's state holds no truncated-step state
    (``estimator.unroll_state`` returns None, e.g. FullES) or the truncated
    step has no ``trajectory_phase``.

    Args:
      estimator: the worker's estimator.
      state: a worker state of the estimator (only its structure is used).
    """
    step = estimator.truncated_step
    trajectory_phase = getattr(step, "trajectory_phase", None)
    # Traced, never run: the unroll state's presence is a property of the state's structure.
    if trajectory_phase is None or jax.eval_shape(estimator.unroll_state, state) is None:
        return None

    def phases(state: Any) -> jax.Array:
        return jnp.asarray(trajectory_phase(estimator.unroll_state(state)), jnp.float32)

    return jax.jit(phases)


class EstimatorWorker:
    """Computes gradient estimates of theta with its own inner problems.

    Args:
      config: the run's config; the estimator and its truncated step are built from it.
      rank: the worker's index; with ``config.seed`` it fixes every key the worker uses.
      restart: how many times this rank has been replaced.

    Attributes:
      estimator: the gradient estimator.
      runner: what runs it (sharded over the local devices, or on one device).
      truncations_per_call: truncations behind each estimate.

    Raises:
      ValueError: if the tasks are to be sharded over the local devices and
        ``estimator.num_tasks`` is not a multiple of their number.
    """

    def __init__(self, config: Config, rank: int, restart: int = 0):
        self.rank = rank
        self.estimator = build_estimator(config)
        self.runner: EstimateRunner = _runner(config, self.estimator)
        self.truncations_per_call = config.estimator.truncations_per_call
        self._key = worker_key(config.seed, rank, restart)
        self._state: Any = None
        # Set with the first state: whether the state has phases is known only then.
        self._phases: Callable[[Any], jax.Array] | None = None
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

        Args:
          theta: the meta-parameters.
          version: the learner version theta belongs to.

        Returns:
          The estimate from ``truncations_per_call`` consecutive truncations,
          with numpy leaves; its metrics include ``compute_time_s`` (the wall
          time of the call) and its ``phases`` are each task's trajectory
          phase after the call (None for estimators without persistent
          trajectories, e.g. FullES).
        """
        start = time.perf_counter()
        if self._state is None:
            self._state = self.runner.init_worker_state(theta, self._key)
            self._phases = _phases_fn(self.estimator, self._state)
        key = self._call_key(version)
        out, metrics = self.runner.compute_gradient_estimate(
            theta, self._state, key, num_truncations=self.truncations_per_call
        )
        self._state = out.state
        phases = None if self._phases is None else np.asarray(self._phases(out.state))
        grad = jax.tree_util.tree_map(np.asarray, out.grad)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["compute_time_s"] = time.perf_counter() - start
        return Estimate(
            grad,
            float(out.mean_loss),
            float(out.weight),
            version,
            self.rank,
            metrics,
            phases=phases,
        )

    @property
    def num_tasks(self) -> int:
        """Inner problems the worker runs side by side."""
        return self.estimator.truncated_step.num_tasks

    @property
    def num_devices(self) -> int:
        """Devices the worker's tasks are spread over (1 when unsharded)."""
        return self.runner.num_devices

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate, counting every task, antithetic member and truncation."""
        return (
            self.estimator.num_members
            * self.num_tasks
            * self.estimator.trunc_length
            * self.truncations_per_call
        )
