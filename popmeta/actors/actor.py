"""The Ray actor that hosts one :class:`~popmeta.actors.worker.EstimatorWorker`.

The actor is built from the picklable :class:`~popmeta.config.Config`; every
JAX object (estimator, jitted functions, device arrays) is created inside the
actor process and never crosses a process boundary. Theta arrives as the
ObjectRef of the learner's one ``ray.put`` per version, which Ray resolves to
the (read-only) numpy pytree; estimates go back by value as numpy arrays.

CPU pinning. XLA's CPU thread pool ignores ``OMP_NUM_THREADS`` and the intra-op
flags; only CPU affinity bounds it, and threads inherit the affinity of the
thread that creates them. So when the population asks for pinning, the actor
sets the affinity of every thread of its process in ``__init__``, before the
worker module (and with it any JAX computation) runs: XLA's pool, created on
first use, then lives on the pinned cores.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from popmeta.config import Config
from popmeta.estimate import Estimate

__all__ = ["EstimatorActor", "pin_process_to_cores"]


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: only the calling thread can be addressed
        return [0]


def pin_process_to_cores(slots: Sequence[int]) -> list[int] | None:
    """Restricts every thread of this process to the cores named by ``slots``.

    Slots index this process's allowed cores (``os.sched_getaffinity``), modulo
    their number: a node may declare more logical Ray CPUs than it has cores,
    and containers may allow only some cores, so a slot is a position, not a
    core id.

    Args:
      slots: core positions, e.g. ``[3]`` for the fourth allowed core.

    Returns:
      The sorted core ids now allowed, or None where the platform has no CPU
      affinity (macOS, Windows).
    """
    if not hasattr(os, "sched_setaffinity") or not slots:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cores = sorted({allowed[slot % len(allowed)] for slot in slots})
    # Linux applies sched_setaffinity to one thread; Ray's threads already run,
    # so each is pinned (new threads, e.g. XLA's pool, inherit the mask).
    for tid in _thread_ids():
        with contextlib.suppress(OSError):  # the thread exited meanwhile
            os.sched_setaffinity(tid, cores)
    return cores


def _threads_within(cores: set[int]) -> bool:
    for tid in _thread_ids():
        try:
            if not os.sched_getaffinity(tid) <= cores:
                return False
        except OSError:
            pass
    return True


def _to_host(tree: Any) -> Any:
    # Ray serialises numpy arrays 2.5-3.5x faster than jax.Array leaves
    # (measured for 1e6-1e7 float32 elements).
    import jax

    return jax.tree_util.tree_map(np.asarray, tree)


@ray.remote
class EstimatorActor:
    """One estimator worker in its own process.

    Args:
      config: the run's config; the worker builds everything from it.
      rank: the worker's rank (fixes its keys with ``config.seed``).
      restart: how many times this rank has been replaced; a replacement gets
        fresh keys, so its inner problems restart at new random offsets.
      pin_cpus: core positions to pin this process to before JAX runs (see
        :func:`pin_process_to_cores`), or None to leave affinity alone.
    """

    def __init__(
        self,
        config: Config,
        rank: int,
        restart: int = 0,
        pin_cpus: Sequence[int] | None = None,
    ):
        self._pinned = pin_process_to_cores(pin_cpus) if pin_cpus else None
        # Imported only now, after pinning: the worker's first JAX computation
        # creates XLA's CPU thread pool, which must inherit the affinity.
        from popmeta.actors.worker import EstimatorWorker

        self.rank = rank
        self.restart = restart
        self._worker = EstimatorWorker(config, rank, restart)

    def compute(self, theta: Any, version: int) -> Estimate:
        """One gradient estimate on theta version ``version``.

        Args:
          theta: the theta pytree; passed as the ObjectRef of the learner's
            ``ray.put``, which Ray resolves before the call runs.
          version: the learner version theta belongs to.

        Returns:
          The estimate with numpy leaves (``phases`` included) and float metrics.
        """
        est = self._worker.compute(theta, version)
        return est._replace(
            grad=_to_host(est.grad),
            mean_loss=float(est.mean_loss),
            weight=float(est.weight),
            metrics={k: float(v) for k, v in est.metrics.items()},
            phases=None if est.phases is None else np.asarray(est.phases),
        )

    def info(self) -> dict[str, Any]:
        """Where and how this actor runs.

        Returns:
          ``rank``, ``restart``, ``node_id``, ``hostname``, ``pid``,
          ``pinned_cores`` (None if not pinned), ``allowed_cores`` (this
          thread's affinity), ``threads_pinned`` (every thread within the
          pinned cores), ``jax_local_device_count``, ``num_devices`` (devices
          the worker's tasks are sharded over), ``num_tasks`` and
          ``steps_per_estimate``.
        """
        import jax

        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {
            "rank": self.rank,
            "restart": self.restart,
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "pinned_cores": self._pinned,
            "allowed_cores": allowed,
            "threads_pinned": self._pinned is not None and _threads_within(set(self._pinned)),
            "jax_local_device_count": jax.local_device_count(),
            "num_devices": int(getattr(self._worker, "num_devices", 1)),
            "num_tasks": int(self._worker.num_tasks),
            "steps_per_estimate": int(self._worker.steps_per_estimate),
        }
