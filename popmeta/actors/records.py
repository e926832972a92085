"""The records an estimator worker hands out: where it runs, and its exported state.

Both cross processes (from a Ray actor to the driver, and an exported state
back to a replacement) and the exported state reaches disk in every
checkpoint, so each is a NamedTuple that says what is in it. This module
imports neither Ray nor JAX: the local engine describes its workers with the
same :class:`ActorInfo` as the actors do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ActorInfo", "WorkerState"]


class ActorInfo(NamedTuple):
    """Where and how one estimator worker runs: what an actor's ``info()`` answers.

    The local engine describes its workers with the same record; the fields
    only an actor process measures keep their defaults there.

    Attributes:
      rank: the worker's rank.
      restart: how many times this rank has been replaced (0: never).
      node_id: the Ray node it runs on; ``"local"`` for the local engine.
      hostname: the host it runs on.
      pid: the id of its process.
      pinned_cores: the core ids its process is pinned to; None if not pinned.
      num_devices: devices the worker's tasks are sharded over (1: unsharded).
      num_tasks: inner problems the worker runs side by side.
      steps_per_estimate: inner steps behind one estimate, counting every
        task, antithetic member and truncation.
      allowed_cores: the CPU affinity of the actor's thread; None where the
        platform has none, and in the local engine.
      threads_pinned: every thread of the actor's process lies within
        ``pinned_cores`` (False when not pinned).
      jax_local_device_count: JAX's local devices in the actor's process.
      start_s: the actor constructor's wall time: building the worker and
        compiling its estimate.
      warm_up_s: the compiling part of ``start_s``.
      compilation_cache_dir: JAX's persistent compilation cache; None when
        it is off.
      compilation_cache_hits: persistent-cache hits during the constructor.
      compilation_cache_misses: persistent-cache misses during the constructor.
      niceness: the actor process's nice value (Ray's ``worker_niceness``;
        above 0, any busier process on its node comes first).
    """

    rank: int
    restart: int
    node_id: str
    hostname: str
    pid: int
    pinned_cores: list[int] | None
    num_devices: int
    num_tasks: int
    steps_per_estimate: int
    allowed_cores: list[int] | None = None
    threads_pinned: bool = False
    jax_local_device_count: int | None = None
    start_s: float | None = None
    warm_up_s: float | None = None
    compilation_cache_dir: str | None = None
    compilation_cache_hits: int | None = None
    compilation_cache_misses: int | None = None
    niceness: int | None = None


class WorkerState(NamedTuple):
    """Everything besides theta that a worker's next estimate depends on.

    What :meth:`~popmeta.actors.worker.EstimatorWorker.export_state` gives and
    :meth:`~popmeta.actors.worker.EstimatorWorker.load_state` takes, as host
    arrays (``jax.ShapeDtypeStruct`` leaves in
    :func:`~popmeta.actors.worker.exported_state_template`).

    Attributes:
      key: the worker's root key, as raw key data (``jax.random.key_data``).
      last_version: int64 scalar: theta version of the worker's last call
        (-1: none yet).
      repeats: int64 scalar: calls on ``last_version`` beyond the first.
      state: the estimator's worker state (inner states, PES accumulators or
        NRES noise).
    """

    key: Any
    last_version: Any
    repeats: Any
    state: Any
