"""The Ray actor that hosts one :class:`~popmeta.actors.worker.EstimatorWorker`.

The actor is built from a picklable :class:`~popmeta.experiment.WorkerSpec`;
every JAX object is created inside the actor process and never crosses a
process boundary. Theta arrives as the learner's one ``ray.put`` per version
(or inline when small); estimates go back by value as numpy arrays.

CPU pinning: only CPU affinity bounds XLA's CPU thread pool, so a pinned
actor sets the affinity of its process's threads in ``__init__``, before any
JAX computation runs. Starting fast: an actor answers ``info()`` (and is
*ready*) only after its estimate is compiled, into JAX's persistent
compilation cache, so a replacement joins at full speed. The Ray and JAX
facts behind both, and the cache's settings: docs/ray.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from popmeta.actors.records import ActorInfo, WorkerState
from popmeta.estimate import Estimate

if TYPE_CHECKING:  # imported by the worker only once the process is pinned
    from popmeta.experiment import WorkerSpec

__all__ = [
    "ActorBuildError",
    "EstimatorActor",
    "default_compilation_cache_dir",
    "pin_process_to_cores",
]

#: JAX's monitoring events for persistent-cache hits and misses.
_CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}


def default_compilation_cache_dir() -> str:
    """The actors' persistent compilation cache unless ``population.env`` names one.

    Per user (cache entries are executables: never shared between users) and
    on the node's local disk (``tempfile.gettempdir()``), where the actors of
    that node find one another's compilations.
    """
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return os.path.join(tempfile.gettempdir(), f"popmeta-jax-cache-{user}")


def use_compilation_cache() -> dict[str, int]:
    """Turns JAX's persistent compilation cache on for this process; call before it compiles.

    JAX reads ``JAX_COMPILATION_CACHE_DIR`` and the thresholds from the
    environment when it is imported, and decides at its first compilation
    whether to use the cache. A directory set in the environment stands; else
    :func:`default_compilation_cache_dir` is used. Unless
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set, every compilation is
    cached: JAX's default (only compilations over one second) would leave out
    most of an estimator's compilations, each of which a replacement would
    then redo.

    Returns:
      Counters of persistent-cache ``hits`` and ``misses`` in this process,
      updated as JAX compiles.
    """
    import jax

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", default_compilation_cache_dir())
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    counts = dict.fromkeys(_CACHE_EVENTS.values(), 0)

    def count(event: str, **kwargs: Any) -> None:
        del kwargs
        if event in _CACHE_EVENTS:
            counts[_CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(count)
    return counts


#: Reads of the thread list :func:`pin_process_to_cores` makes at most: a process
#: that keeps starting threads from unpinned ones cannot hold it up for ever.
_PINNING_PASSES = 20


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
    # so each is pinned, and a thread started later inherits its creator's
    # mask. One started by a thread not yet pinned, after the list was read,
    # would keep every core: the list is read again until no thread is outside.
    for _ in range(_PINNING_PASSES):
        outside = _threads_outside(set(cores))
        if not outside:
            break
        for tid in outside:
            with contextlib.suppress(OSError):  # the thread exited meanwhile
                os.sched_setaffinity(tid, cores)
    return cores


def _threads_outside(cores: set[int]) -> list[int]:
    """This process's threads allowed to run on a core outside ``cores``."""
    outside = []
    for tid in _thread_ids():
        with contextlib.suppress(OSError):  # the thread exited meanwhile
            if not os.sched_getaffinity(tid) <= cores:
                outside.append(tid)
    return outside


class ActorBuildError(RuntimeError):
    """The actor could not build its worker; raised by its ``info()``, naming where it ran."""


@ray.remote
class EstimatorActor:
    """One estimator worker in its own process.

    Args:
      spec: the :class:`~popmeta.experiment.WorkerSpec` the worker is built
        from, pickled (``ray.cloudpickle``). Unpickled by the constructor, so
        that a module of the user's the actor cannot import is reported like
        any other failure to build (see :class:`ActorBuildError`).
      rank: the worker's rank (fixes its keys with the run's seed).
      restart: how many times this rank has been replaced; a replacement gets
        fresh keys, so its inner problems restart at new random offsets.
      pin_cpus: core positions to pin this process to before JAX runs (see
        :func:`pin_process_to_cores`), or None to leave affinity alone.

    The constructor returns once the estimate is compiled (see the module's
    docstring), so ``info()``, queued right after it, answers when the actor is
    ready to compute at full speed. A constructor that fails keeps its error
    for ``info()`` to raise as :class:`ActorBuildError` with the actor's node
    and host in it, which the supervisor reports (a constructor exception
    reaches Ray's caller only as a traceback in text).
    """

    def __init__(
        self,
        spec: bytes,
        rank: int,
        restart: int = 0,
        pin_cpus: Sequence[int] | None = None,
    ):
        self.rank = rank
        self.restart = restart
        self._build_error: BaseException | None = None
        try:
            self._build(ray.cloudpickle.loads(spec), pin_cpus)
        except Exception as err:
            self._build_error = err

    def _build(self, spec: WorkerSpec, pin_cpus: Sequence[int] | None) -> None:
        start = time.perf_counter()
        # Before anything compiles: JAX decides once per process whether to use the cache.
        cache_counts = use_compilation_cache()
        self._pinned = pin_process_to_cores(pin_cpus) if pin_cpus else None
        # Imported only now, after pinning: the worker's first JAX computation
        # creates XLA's CPU thread pool, which must inherit the affinity.
        from popmeta.actors.worker import EstimatorWorker

        self._worker = EstimatorWorker(spec, self.rank, self.restart)
        built = time.perf_counter()
        self._worker.throwaway(self._worker.truncations_per_call)
        done = time.perf_counter()
        self._start = {
            "start_s": done - start,
            "warm_up_s": done - built,
            "compilation_cache_hits": cache_counts["hits"],
            "compilation_cache_misses": cache_counts["misses"],
        }

    def compute(self, theta: Any, version: int) -> Estimate:
        """One gradient estimate on theta version ``version``.

        Args:
          theta: the theta pytree; passed by value when small, else as the
            ObjectRef of the learner's ``ray.put``, which Ray resolves before
            the call runs.
          version: the learner version theta belongs to.

        Returns:
          The worker's estimate, numpy leaves and float metrics as it made
          them (Ray ships numpy arrays faster than ``jax.Array`` leaves).
        """
        return self._worker.compute(theta, version)

    def throwaway(self, theta: Any, num_truncations: int) -> Estimate | None:
        """A throwaway estimate on ``theta`` that keeps its state for the next one; see
        :meth:`~popmeta.actors.worker.EstimatorWorker.throwaway`. Timed, it tells
        the driver what a call costs (:mod:`popmeta.population.call_size`).
        """
        return self._worker.throwaway(num_truncations, theta, keep=True)

    def use_truncations_per_call(self, num_truncations: int) -> int:
        """Compiles and then runs ``num_truncations`` truncations per call; returns the
        inner steps behind one estimate now."""
        self._worker.use_truncations_per_call(num_truncations)
        return int(self._worker.steps_per_estimate)

    def export_state(self) -> WorkerState | None:
        """The worker's :meth:`~popmeta.actors.worker.EstimatorWorker.export_state`.

        Runs after the calls queued before it, so it is the state those calls
        leave behind.
        """
        return self._worker.export_state()

    def load_state(self, exported: WorkerState) -> None:
        """The worker continues from ``exported``; see
        :meth:`~popmeta.actors.worker.EstimatorWorker.load_state`.

        Raises:
          ValueError: it does not fit the actor's config (the worker is left as it was).
        """
        self._worker.load_state(exported)

    def info(self) -> ActorInfo:
        """Where and how this actor runs (see :class:`~popmeta.actors.records.ActorInfo`).

        Raises:
          ActorBuildError: the constructor failed; its exception is the cause.
        """
        if self._build_error is not None:
            err = self._build_error
            node = ray.get_runtime_context().get_node_id()
            raise ActorBuildError(
                f"{type(err).__name__}: {err} (on host {socket.gethostname()}, node {node})"
            ) from err
        import jax

        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return ActorInfo(
            rank=self.rank,
            restart=self.restart,
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            pinned_cores=self._pinned,
            num_devices=int(getattr(self._worker, "num_devices", 1)),
            num_tasks=int(self._worker.num_tasks),
            steps_per_estimate=int(self._worker.steps_per_estimate),
            allowed_cores=allowed,
            threads_pinned=self._pinned is not None and not _threads_outside(set(self._pinned)),
            jax_local_device_count=jax.local_device_count(),
            compilation_cache_dir=jax.config.jax_compilation_cache_dir,
            niceness=os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
            **self._start,
        )
