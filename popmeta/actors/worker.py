"""An estimator worker: one gradient estimator, its seed and its persistent state.

This is the unit of the population. The local engine runs workers in the
driver; the Ray engine wraps the same class in an actor, so both engines
compute bit-for-bit the same estimates for the same seeds. The worker calls
one :class:`~popmeta.core.estimators.EstimateRunner` (tasks sharded over
several local devices, or the plain single-device runner), averaging
``estimator.truncations_per_call`` truncations per call. A *throwaway*
estimate (:meth:`EstimatorWorker.throwaway`) runs on a state of its own, to
compile a call or time one without touching the worker's estimates.

Its *exported state* (:meth:`EstimatorWorker.export_state`) is everything
besides theta that decides its next estimate, so a worker that loads it
(:meth:`EstimatorWorker.load_state`) continues bit for bit: the exact resume
of docs/checkpoints.md, whose parts docs/design.md ("Learner") lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from popmeta.actors.records import WorkerState
from popmeta.core.estimators import EstimateRunner, GradientEstimator, make_runner
from popmeta.estimate import Estimate
from popmeta.experiment import WorkerSpec, build_estimator

__all__ = ["EstimatorWorker", "FusionCarry", "call_key", "exported_state_template", "worker_key"]

# Called eagerly, ``jax.random.fold_in`` dispatches its primitives one by one;
# jitted it is one call, and every actor call derives its key with it
# (docs/performance.md, "Why it is fast").
_fold_in = jax.jit(jax.random.fold_in)


def worker_key(seed: int, rank: int, restart: int = 0) -> jax.Array:
    """Root key of worker ``rank``: independent of how many workers there are.

    A replacement worker (``restart`` > 0) gets fresh keys, so its inner
    problems restart at new random offsets.
    """
    key = jax.random.fold_in(jax.random.key(seed), rank + 1)
    return jax.random.fold_in(key, restart) if restart else key


def call_key(
    root: jax.Array, version: jax.Array, last_version: jax.Array, repeats: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The key of a call on theta ``version``, traced: :meth:`EstimatorWorker._call_key` in a program.

    The same rule, for the local engine's fused rounds, where the version is
    a traced learner step: ``fold_in(root, version + 1)``, or repeat ``r`` of
    the last version's key (``tests/actors/test_worker.py`` holds the two to
    the same keys).

    Args:
      root: the worker's root key.
      version: theta's version (int32).
      last_version: the version of the worker's previous call (-1 before any).
      repeats: repeats of ``last_version`` so far.

    Returns:
      ``(key, repeats)`` after this call.
    """
    key = jax.random.fold_in(root, version + 1)
    repeated = version == last_version
    repeats = jnp.where(repeated, repeats + 1, 0)
    repeat_key = jax.random.fold_in(jax.random.fold_in(key, 0), repeats)
    return jax.lax.select(repeated, repeat_key, key), repeats


class FusionCarry(NamedTuple):
    """What a worker hands to a fused program and takes back: its state and its key rule's counters.

    Attributes:
      state: the estimator's worker state (donated to the program).
      key: the worker's root key.
      last_version: theta version of the latest call (int32; -1 before any).
      repeats: calls on ``last_version`` beyond the first (int32).
    """

    state: Any
    key: jax.Array
    last_version: Any
    repeats: Any


def exported_state_template(
    spec: WorkerSpec, estimator: GradientEstimator | None = None
) -> WorkerState:
    """The structure, shapes and dtypes of :meth:`EstimatorWorker.export_state`.

    Traced with ``jax.eval_shape``: nothing is computed or compiled. Every
    rank of a run has the same template.

    Args:
      spec: what the workers are built from.
      estimator: the estimator built from ``spec``, if at hand (else it is built).

    Returns:
      A :class:`~popmeta.actors.records.WorkerState` with
      ``jax.ShapeDtypeStruct`` leaves: the template a checkpoint's worker
      states are restored into
      (:func:`~popmeta.learner.checkpoint_layout.load_run_checkpoint`).
    """
    estimator = estimator or build_estimator(spec.sections)
    key = worker_key(spec.sections.seed, 0)
    counter = jax.ShapeDtypeStruct((), np.int64)
    return WorkerState(
        key=jax.eval_shape(jax.random.key_data, key),
        last_version=counter,
        repeats=counter,
        state=jax.eval_shape(estimator.init_worker_state, spec.theta, key),
    )


def _check_fits(template: Any, tree: Any) -> None:
    """Raises ValueError naming the first leaf of ``tree`` that does not fit ``template``."""
    expected = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]
    }
    found = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    for name in sorted(expected.keys() ^ found.keys()):
        what = "missing" if name in expected else "not expected"
        raise ValueError(f"worker state entry {name} is {what} for this config")
    for name, want in expected.items():
        got = found[name]
        dtype = np.dtype(got.dtype)
        if np.shape(got) != want.shape or dtype != want.dtype:
            raise ValueError(
                f"worker state entry {name}: expected {want.dtype}{list(want.shape)} for this "
                f"config, found {dtype}{list(np.shape(got))}"
            )


def _runner(shard_tasks: bool, estimator: GradientEstimator) -> EstimateRunner:
    """The runner of the worker's estimator: sharded over the local devices when there are several.

    Args:
      shard_tasks: whether sharding is allowed (``population.shard_tasks``).
      estimator: the worker's estimator.

    Returns:
      A ``ShardedRunner`` over ``jax.local_devices()`` when sharding is allowed
      and there are several, else the estimator's ``SingleDeviceRunner``.

    Raises:
      ValueError: if the tasks are to be sharded and do not split evenly over the devices.
    """
    devices = jax.local_devices() if shard_tasks else []
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
      spec: what the worker is built from.
      rank: the worker's index; with the run's seed it fixes every key the worker uses.
      restart: how many times this rank has been replaced.

    Attributes:
      estimator: the gradient estimator.
      runner: what runs it (sharded over the local devices, or on one device).
      truncations_per_call: truncations behind each estimate; 1 until
        :meth:`use_truncations_per_call` sets it when the spec says ``auto``.

    Raises:
      ValueError: if the tasks are to be sharded over the local devices and
        ``estimator.num_tasks`` is not a multiple of their number.
    """

    def __init__(self, spec: WorkerSpec, rank: int, restart: int = 0):
        # Each worker builds its own estimator, as each actor does: a task that
        # pulls host batches keeps its iterator in it, one per worker.
        self.rank = rank
        self.spec = spec
        self.estimator = build_estimator(spec.sections)
        self.runner: EstimateRunner = _runner(spec.shard_tasks, self.estimator)
        configured = spec.sections.estimator.truncations_per_call
        self.truncations_per_call: int = 1 if configured == "auto" else configured
        self._key = worker_key(spec.sections.seed, rank, restart)
        self._state: Any = None
        self._throwaway_state: Any = None
        # A loaded state, as host arrays: placed on the devices by the next call.
        self._loaded: Any = None
        self._template: WorkerState | None = None
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
        key = _fold_in(self._key, version + 1)
        if version == self._last_version:
            self._repeats += 1
            return _fold_in(_fold_in(key, 0), self._repeats)
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
            self._start(theta)
        key = self._call_key(version)
        out, metrics = self.runner.compute_gradient_estimate(
            theta, self._state, key, num_truncations=self.truncations_per_call
        )
        self._state = out.state
        phases = None if self._phases is None else np.asarray(self._phases(out.state))
        return self._estimate(out, metrics, phases, version, start)

    def _estimate(
        self, out: Any, metrics: Any, phases: np.ndarray | None, version: int, start: float
    ) -> Estimate:
        """The estimate with host arrays, timed from ``start``."""
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
    def can_throw_away(self) -> bool:
        """Whether throwaway estimates leave the worker's estimates as they are.

        Not when the truncated step pulls host batches: a throwaway estimate
        would consume batches that belong to the worker's estimates.
        """
        return not getattr(self.estimator.truncated_step, "host_data", False)

    def throwaway(
        self, num_truncations: int, theta: Any = None, keep: bool = False
    ) -> Estimate | None:
        """An estimate of ``num_truncations`` truncations that changes nothing of the worker.

        It runs on a state of its own, from a key of its own (the first from a
        theta of zeros), so the worker's estimates stay exactly those of a
        worker that never ran one. It compiles (or, timed, measures) the
        function the worker's calls use: same shapes and dtypes, theta as
        numpy arrays as it arrives from the learner.

        Args:
          num_truncations: truncations behind it.
          theta: the meta-parameters (default zeros of the spec's theta).
          keep: keep the throwaway state for the next one (timed calls),
            rather than free it.

        Returns:
          The estimate, as :meth:`compute` returns it (``compute_time_s`` among
          its metrics); None when the worker cannot throw one away
          (:attr:`can_throw_away`).
        """
        if not self.can_throw_away:
            return None
        start = time.perf_counter()
        if theta is None:
            theta = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), self.spec.theta)
        key = jax.random.key(0)
        if self._throwaway_state is None:
            self._throwaway_state = self.runner.init_worker_state(theta, key)
        out, metrics = self.runner.compute_gradient_estimate(
            theta, self._throwaway_state, _fold_in(key, 1), num_truncations=num_truncations
        )
        self._throwaway_state = out.state if keep else None
        return self._estimate(out, metrics, None, -1, start)

    def hand_over(self, theta: Callable[[], Any]) -> FusionCarry:
        """Hands the worker's state to a fused program (:mod:`popmeta.population.fused`).

        The worker holds no state until :meth:`take_back`, which must follow:
        the program donates it.

        Args:
          theta: gives the meta-parameters; called only by a fresh worker,
            which builds its first state with them.
        """
        if self._state is None:
            self._start(theta())
        state, self._state = self._state, None
        last = -1 if self._last_version is None else self._last_version
        return FusionCarry(state, self._key, np.int32(last), np.int32(self._repeats))

    def take_back(self, carry: FusionCarry) -> np.ndarray | None:
        """Continues after a fused program, as if its calls had been this worker's own.

        Returns:
          Each task's trajectory phase after the program's last call (None
          where the estimator has none), as :meth:`compute` reports them.
        """
        self._state = carry.state
        last = int(carry.last_version)
        self._last_version = None if last < 0 else last
        self._repeats = int(carry.repeats)
        return None if self._phases is None else np.asarray(self._phases(carry.state))

    def use_truncations_per_call(self, num_truncations: int) -> None:
        """Runs ``num_truncations`` truncations per call from now on, compiled before it returns."""
        self.truncations_per_call = num_truncations
        self.throwaway(num_truncations)

    def _start(self, theta: Any) -> None:
        """The worker's first state (fresh or loaded), and the phases function it fixes."""
        self._state = self._first_state(theta)
        self._phases = _phases_fn(self.estimator, self._state)

    def _first_state(self, theta: Any) -> Any:
        """A fresh state, or the loaded one placed where the runner keeps a fresh one.

        A fresh state is built either way: it carries the placement (sharded
        over the local devices or not), and a sharded runner fixes its
        shardings with it.
        """
        fresh = self.runner.init_worker_state(theta, self._key)
        if self._loaded is None:
            return fresh
        loaded, self._loaded = self._loaded, None
        return jax.tree_util.tree_map(lambda f, x: jax.device_put(x, f.sharding), fresh, loaded)

    def export_state(self) -> WorkerState | None:
        """What the worker's next estimate depends on besides theta, as host arrays.

        Call it between :meth:`compute` calls. The arrays are copies: the
        device buffers of the state are donated to the next call.

        Returns:
          The worker's :class:`~popmeta.actors.records.WorkerState`, with the
          structure of :func:`exported_state_template`; None before the first
          estimate (a fresh worker of this rank starts the same way).
        """
        state = self._state if self._state is not None else self._loaded
        if state is None:
            return None
        last = -1 if self._last_version is None else self._last_version
        return WorkerState(
            key=np.array(jax.random.key_data(self._key)),
            last_version=np.int64(last),
            repeats=np.int64(self._repeats),
            state=jax.tree_util.tree_map(lambda x: np.array(x, copy=True), state),
        )

    def load_state(self, exported: WorkerState) -> None:
        """Continues from an :meth:`export_state` of a worker of the same config.

        The next :meth:`compute` returns what the exporting worker's next call
        would have returned for the same theta and version.

        Args:
          exported: an exported state (host or device arrays).

        Raises:
          ValueError: it does not fit this worker's config; the message names
            the first entry that differs. The worker is then left as it was.
        """
        if self._template is None:
            self._template = exported_state_template(self.spec, self.estimator)
        _check_fits(self._template, exported)
        impl = jax.random.key_impl(self._key)
        self._key = jax.random.wrap_key_data(np.asarray(exported.key), impl=impl)
        last = int(exported.last_version)
        self._last_version = None if last < 0 else last
        self._repeats = int(exported.repeats)
        self._loaded = jax.tree_util.tree_map(np.asarray, exported.state)
        self._state = None

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
