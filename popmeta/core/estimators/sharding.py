"""Sharding an estimator's tasks over several local devices with ``jax.sharding``.

A worker that sees several devices (the GPUs given to one actor, or CPU devices
forced with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``) splits its
``num_tasks`` inner problems evenly over them: a 1-D mesh with axis ``tasks``,
every worker-state leaf sharded along its task axis
(``GradientEstimator.state_task_axes``), theta and keys replicated. The jitted
estimate is given matching ``in_shardings`` / ``out_shardings`` and donates the
state, so the state never leaves its devices between calls; only the small
theta-shaped estimate is replicated (one all-reduce over tasks).

The partitioner splits the per-task work; random numbers do not depend on the
sharding (``jax_threefry_partitionable``, the default), so a sharded estimator
computes the same estimates as an unsharded one up to the order of the
cross-device sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from popmeta.core.estimators.base import (
    EstimatorOut,
    GradientEstimator,
    _check_num_truncations,
    _fixed_truncations,
    run_truncations,
)

__all__ = ["TASK_AXIS", "TaskSharding", "task_mesh"]

PyTree = Any

#: Name of the mesh axis that tasks are split over.
TASK_AXIS = "tasks"


def task_mesh(devices: Sequence[jax.Device], axis_name: str = TASK_AXIS) -> Mesh:
    """A 1-D mesh over ``devices`` with one axis, ``axis_name``.

    The axis is ``Auto``: shardings are fixed at the jit boundary and the
    compiler partitions everything in between, so the estimator code stays
    unaware of the mesh (``jax.make_mesh`` defaults to ``Explicit`` axes,
    which would make every op inside the estimate sharding-typed).
    """
    devices = list(devices)
    return jax.make_mesh(
        (len(devices),), (axis_name,), axis_types=(AxisType.Auto,), devices=devices
    )


class TaskSharding:
    """Runs an estimator with its tasks split over the devices of a 1-D mesh.

    Args:
      estimator: the estimator; its ``truncated_step.num_tasks`` must be a
        multiple of the number of devices.
      devices: the devices to shard over (typically ``jax.local_devices()``).
      axis_name: name of the mesh axis.

    Raises:
      ValueError: if the tasks do not split evenly over the devices.
    """

    def __init__(
        self,
        estimator: GradientEstimator,
        devices: Sequence[jax.Device],
        axis_name: str = TASK_AXIS,
    ):
        num_tasks = estimator.truncated_step.num_tasks
        num_devices = len(devices)
        if num_devices < 1:
            raise ValueError("TaskSharding needs at least one device")
        if num_tasks % num_devices:
            raise ValueError(
                f"num_tasks ({num_tasks}) must be a multiple of the number of devices "
                f"({num_devices}) to shard the tasks over them"
            )
        self.estimator = estimator
        self.axis_name = axis_name
        self.mesh = task_mesh(devices, axis_name)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        # Host data from `get_batch(steps)` is laid out [steps, tasks, ...].
        self.data_sharding = NamedSharding(self.mesh, PartitionSpec(None, axis_name))
        self._state_sharding: PyTree = None
        self._init_fn: Any = None
        self._estimate_fns: dict[int, Any] = {}

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def state_sharding(self, state: Any) -> PyTree:
        """A ``NamedSharding`` per leaf of ``state`` (arrays or shape structs), split on its task axis."""
        axes = self.estimator.state_task_axes(state)

        def leaf_sharding(axis: int, leaf: Any) -> NamedSharding:
            del leaf
            return NamedSharding(self.mesh, PartitionSpec(*([None] * axis), self.axis_name))

        return jax.tree_util.tree_map(leaf_sharding, axes, state)

    def _ensure_state_sharding(self, theta: PyTree, key: jax.Array, outer_state: Any) -> PyTree:
        if self._state_sharding is None:
            shapes = jax.eval_shape(self.estimator.init_worker_state, theta, key, outer_state)
            self._state_sharding = self.state_sharding(shapes)
        return self._state_sharding

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        """``estimator.init_worker_state``, computed in place on the devices it is sharded over."""
        state_sharding = self._ensure_state_sharding(theta, key, outer_state)
        if self._init_fn is None:
            rep = self.replicated
            self._init_fn = jax.jit(
                self.estimator.init_worker_state,
                in_shardings=(rep, rep, rep),
                out_shardings=state_sharding,
            )
        return self._init_fn(theta, key, outer_state)

    def jitted_estimate(self, num_truncations: int = 1) -> Any:
        """Sharded, jitted ``estimate`` (K = 1) or ``estimate_many`` (K > 1), state donated.

        The callable takes ``(theta, state, key, data, outer_state)``. Call
        ``init_worker_state`` first: it fixes the state's sharding.
        """
        num_truncations = _check_num_truncations(num_truncations)
        if self._state_sharding is None:
            raise RuntimeError("call init_worker_state before jitted_estimate")
        fn = self._estimate_fns.get(num_truncations)
        if fn is None:
            rep, state_sharding = self.replicated, self._state_sharding
            target = (
                self.estimator.estimate
                if num_truncations == 1
                else _fixed_truncations(self.estimator, num_truncations)
            )
            fn = jax.jit(
                target,
                in_shardings=(rep, state_sharding, rep, self.data_sharding, rep),
                # A single sharding is a prefix for the whole grad / metrics pytree.
                out_shardings=(EstimatorOut(rep, rep, rep, state_sharding), rep),
                donate_argnums=(1,),
            )
            self._estimate_fns[num_truncations] = fn
        return fn

    def compute_gradient_estimates(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        num_truncations: int = 1,
        outer_state: Any = None,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """Sharded ``compute_gradient_estimate(s)``; ``state`` is donated and stays sharded.

        Args:
          theta: meta-parameters (any placement; replicated over the mesh).
          state: the sharded worker state from ``init_worker_state`` or a previous call.
          key: key of the call.
          num_truncations: truncations behind the estimate.
          outer_state: passed through.

        Returns:
          ``(EstimatorOut, metrics)`` with grad, loss, weight and metrics
          replicated and the next state sharded like ``state``.
        """
        num_truncations = _check_num_truncations(num_truncations)
        one = self.jitted_estimate(1)
        if num_truncations == 1:
            data = self.estimator.truncated_step.get_batch(self.estimator.trunc_length)
            return one(theta, state, key, data, outer_state)
        return run_truncations(
            self.estimator,
            one,
            self.jitted_estimate(num_truncations),
            theta,
            state,
            key,
            num_truncations,
            outer_state,
        )
