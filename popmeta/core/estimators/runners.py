"""Runners: what a worker calls to turn an estimator into jitted gradient estimates.

An estimator's ``estimate`` and ``estimate_many`` are pure functions. A runner
owns their compiled forms and the host side of a call: it fetches host data
(when the truncated step has any), donates the worker state to the compiled
call so that its buffers are reused, and combines several truncations into one
estimate. Every runner follows :class:`EstimateRunner`:
:class:`SingleDeviceRunner` runs on JAX's default device (every estimator
holds one), :class:`ShardedRunner` splits the estimator's tasks over several
local devices, and :func:`make_runner` picks between them. How sharding and
several truncations per call work: docs/design.md, "Contracts".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from popmeta.core.estimators.estimator_out import EstimatorOut
from popmeta.core.estimators.truncations import (
    accumulate,
    check_num_truncations,
    truncation_keys,
    weighted_means,
    zero_sums,
)

if TYPE_CHECKING:  # the estimator builds its runner (GradientEstimator.runner)
    from popmeta.core.estimators.base import GradientEstimator

__all__ = [
    "TASK_AXIS",
    "EstimateRunner",
    "ShardedRunner",
    "SingleDeviceRunner",
    "estimate_fn",
    "make_runner",
    "task_mesh",
]

PyTree = Any
#: A compiled estimate: ``(theta, state, key, data, outer_state) -> (EstimatorOut, metrics)``.
CompiledEstimate = Callable[..., tuple[EstimatorOut, dict[str, jax.Array]]]

#: Name of the mesh axis that tasks are split over.
TASK_AXIS = "tasks"


@runtime_checkable
class EstimateRunner(Protocol):
    """Runs an estimator's truncations as compiled calls on its devices.

    Attributes:
      estimator: the estimator it runs.
      num_devices: devices the estimator's tasks are spread over (1 unsharded).
    """

    estimator: GradientEstimator

    @property
    def num_devices(self) -> int:
        """Devices the estimator's tasks are spread over (1 when unsharded)."""
        ...

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        """``estimator.init_worker_state``, compiled and placed where the runner runs."""
        ...

    def compute_gradient_estimate(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        outer_state: Any = None,
        *,
        num_truncations: int = 1,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """One estimate from ``num_truncations`` consecutive truncations.

        Args:
          theta: meta-parameters.
          state: the worker state from ``init_worker_state`` or the previous
            call; it is donated and must not be used afterwards.
          key: key of the call; truncation ``k`` uses
            ``truncation_keys(key, num_truncations)[k]``.
          outer_state: passed through to the estimator.
          num_truncations: K; 1 is exactly ``estimator.estimate``.

        Returns:
          ``(EstimatorOut, metrics)`` as ``estimator.estimate_many`` returns
          them; ``out.state`` is the state for the next call.
        """
        ...


def _estimate_k(estimator: GradientEstimator, num_truncations: int) -> CompiledEstimate:
    """``estimate_many`` with K bound, taking the same arguments as ``estimate``."""

    def estimate_k(theta, state, key, data=None, outer_state=None):
        return estimator.estimate_many(theta, state, key, num_truncations, data, outer_state)

    return estimate_k


def estimate_fn(estimator: GradientEstimator, num_truncations: int) -> CompiledEstimate:
    """What a runner compiles for K truncations: ``estimate`` itself for K = 1 (no scan).

    Args:
      estimator: the estimator.
      num_truncations: K.

    Returns:
      A function of ``(theta, state, key, data=None, outer_state=None)``.
    """
    return estimator.estimate if num_truncations == 1 else _estimate_k(estimator, num_truncations)


_jitted_accumulate = jax.jit(accumulate)
_jitted_means = jax.jit(weighted_means)


class _CompiledRunner:
    """What the runners share: one compiled estimate per K, and the host side of a call.

    Subclasses say how to compile (``_compile``); the cache and the call are here.
    """

    estimator: GradientEstimator
    _estimate_fns: dict[int, CompiledEstimate]

    def _compile(self, num_truncations: int) -> CompiledEstimate:
        raise NotImplementedError

    def jitted_estimate(self, num_truncations: int = 1) -> CompiledEstimate:
        """Jitted ``estimate`` (K = 1) or ``estimate_many`` (K > 1), the state donated.

        Args:
          num_truncations: K.

        Returns:
          A callable taking ``(theta, state, key, data, outer_state)``; the
          same object for every call with the same K.
        """
        num_truncations = check_num_truncations(num_truncations)
        fn = self._estimate_fns.get(num_truncations)
        if fn is None:
            fn = self._estimate_fns[num_truncations] = self._compile(num_truncations)
        return fn

    def compute_gradient_estimate(
        self,
        theta: PyTree,
        state: Any,
        key: jax.Array,
        outer_state: Any = None,
        *,
        num_truncations: int = 1,
    ) -> tuple[EstimatorOut, dict[str, jax.Array]]:
        """:meth:`EstimateRunner.compute_gradient_estimate`; ``state`` is donated.

        On-device data: one compiled call. Host data and K > 1: K compiled
        ``estimate`` calls, one ``get_batch`` each, combined with the weighted
        sums of ``estimate_many``.
        """
        num_truncations = check_num_truncations(num_truncations)
        estimator = self.estimator
        step = estimator.truncated_step
        data = step.get_batch(estimator.trunc_length)
        if num_truncations == 1 or data is None:
            return self.jitted_estimate(num_truncations)(theta, state, key, data, outer_state)
        one = self.jitted_estimate(1)
        keys = truncation_keys(key, num_truncations)
        sums = None
        for k in range(num_truncations):
            if k:
                data = step.get_batch(estimator.trunc_length)
            out, metrics = one(theta, state, keys[k], data, outer_state)
            state = out.state
            if sums is None:
                sums = zero_sums(out, metrics)
            # The state stays out of the sums: it is donated to the next call.
            sums = _jitted_accumulate(sums, out._replace(state=()), metrics)
        grad, mean_loss, weight, metrics = _jitted_means(sums)
        return EstimatorOut(grad, mean_loss, weight, state), metrics


class SingleDeviceRunner(_CompiledRunner):
    """Runs an estimator on JAX's default device, the worker state donated.

    One compiled function per K (truncations per call), created on first use
    and reused. ``GradientEstimator.runner`` holds one per estimator.

    Args:
      estimator: the estimator to run.
    """

    def __init__(self, estimator: GradientEstimator):
        self.estimator = estimator
        self._init_fn: Any = None
        self._estimate_fns: dict[int, CompiledEstimate] = {}

    @property
    def num_devices(self) -> int:
        """1: the tasks are not split."""
        return 1

    def init_worker_state(self, theta: PyTree, key: jax.Array, outer_state: Any = None) -> Any:
        """``estimator.init_worker_state``, jitted."""
        if self._init_fn is None:
            self._init_fn = jax.jit(self.estimator.init_worker_state)
        return self._init_fn(theta, key, outer_state)

    def _compile(self, num_truncations: int) -> CompiledEstimate:
        return jax.jit(estimate_fn(self.estimator, num_truncations), donate_argnums=(1,))


def task_mesh(devices: Sequence[jax.Device], axis_name: str = TASK_AXIS) -> Mesh:
    """A 1-D mesh over ``devices`` with one axis, ``axis_name``.

    The axis is ``Auto``: shardings are fixed at the jit boundary and the
    compiler partitions everything in between, so the estimator code stays
    unaware of the mesh (``jax.make_mesh`` defaults to ``Explicit`` axes,
    which would make every op inside the estimate sharding-typed).

    Args:
      devices: the mesh's devices, in order.
      axis_name: name of the mesh axis.

    Returns:
      The mesh.
    """
    devices = list(devices)
    return jax.make_mesh(
        (len(devices),), (axis_name,), axis_types=(AxisType.Auto,), devices=devices
    )


class ShardedRunner(_CompiledRunner):
    """Runs an estimator with its tasks split over the devices of a 1-D mesh.

    Every worker-state leaf is split along its task axis
    (``estimator.state_task_axes``); theta, keys, the estimate and the metrics
    are replicated; host data (laid out ``[steps, tasks, ...]``) is split
    along its task axis. The state is donated and stays on its devices.

    Args:
      estimator: the estimator; its ``truncated_step.num_tasks`` must be a
        multiple of the number of devices.
      devices: the devices to shard over (typically ``jax.local_devices()``).
      axis_name: name of the mesh axis.

    Raises:
      ValueError: if there are no devices or the tasks do not split evenly over them.
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
            raise ValueError("ShardedRunner needs at least one device")
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
        self._estimate_fns: dict[int, CompiledEstimate] = {}

    @property
    def num_devices(self) -> int:
        """Devices of the mesh the tasks are split over."""
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

    def _compile(self, num_truncations: int) -> CompiledEstimate:
        """The sharded compile; ``init_worker_state`` must have fixed the state's sharding.

        Raises:
          RuntimeError: before ``init_worker_state``.
        """
        if self._state_sharding is None:
            raise RuntimeError("call init_worker_state before jitted_estimate")
        rep, state_sharding = self.replicated, self._state_sharding
        return jax.jit(
            estimate_fn(self.estimator, num_truncations),
            in_shardings=(rep, state_sharding, rep, self.data_sharding, rep),
            # A single sharding is a prefix for the whole grad / metrics pytree.
            out_shardings=(EstimatorOut(rep, rep, rep, state_sharding), rep),
            donate_argnums=(1,),
        )


def make_runner(
    estimator: GradientEstimator, devices: Sequence[jax.Device] | None = None
) -> EstimateRunner:
    """The runner for ``estimator`` on ``devices``.

    Args:
      estimator: the estimator to run.
      devices: local devices to spread its tasks over; None or a single device
        means no sharding.

    Returns:
      A :class:`ShardedRunner` over ``devices`` when there are several;
      otherwise a :class:`SingleDeviceRunner`, which runs on JAX's default
      device.

    Raises:
      ValueError: if the tasks do not split evenly over several devices.
    """
    devices = list(devices or ())
    if len(devices) > 1:
        return ShardedRunner(estimator, devices)
    return SingleDeviceRunner(estimator)
