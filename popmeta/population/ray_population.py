"""The Ray population: estimator actors on any node, fed by the learner.

:class:`RayPopulation` is a gather policy (:class:`SyncGather` or
:class:`AsyncGather`) on top of an
:class:`~popmeta.population.supervisor.ActorSupervisor`, which owns the
actors. Theta crosses to the actors once per version (one ``ray.put``, or
inside each call when it is at most :data:`INLINE_THETA_BYTES`); estimates
come back by value. Sync rounds return one estimate per ready actor in rank
order, so a run without actor losses is deterministic; async gathering takes
estimates in completion order, bounds their staleness, and accepts a starving
rank's estimate whatever its staleness so no actor's tasks vanish from the
meta-gradient. Lost actors are replaced with fresh keys. The population never
starts or stops Ray. What each mode guarantees, and why:
docs/population.md.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import ray

from popmeta.accelerator_memory import actor_env_vars
from popmeta.actors.actor import EstimatorActor
from popmeta.actors.records import ActorInfo, WorkerState
from popmeta.config import PopulationConfig
from popmeta.estimate import Estimate
from popmeta.experiment import WorkerSpec
from popmeta.population.base import Gathered, WorkerRestore
from popmeta.population.call_size import RoundCost
from popmeta.population.staleness import staleness_warning
from popmeta.population.supervisor import ActorSupervisor
from popmeta.xla_flags import with_host_devices, without_host_devices

__all__ = [
    "STARVING_SPACINGS",
    "AsyncGather",
    "RayPopulation",
    "SyncGather",
    "job_runtime_env",
    "starving_after",
    "theta_argument",
]

log = logging.getLogger("popmeta")

#: Thetas up to this size go to actors by value in each call rather than through
#: one ``ray.put`` (below Ray's own 100 KiB limit for inlined call arguments).
INLINE_THETA_BYTES = 64 * 1024

#: How many times the average spacing of one rank's accepted estimates an async
#: rank may go without one before it is starving (see :func:`starving_after`).
STARVING_SPACINGS = 8


def job_runtime_env(
    runtime_env: Mapping[str, Any], found_modules: Sequence[str]
) -> dict[str, Any] | None:
    """The job's Ray runtime environment: ``population.runtime_env``, and the modules of the
    user's kinds the driver found only beside the config file (in ``py_modules``).

    Ray uploads local ``working_dir`` and ``py_modules`` paths from the job's
    runtime environment only (``ray.init``), never from an actor's; the actors
    inherit it. None when there is nothing to set.

    Args:
      runtime_env: ``population.runtime_env``.
      found_modules: the directories of modules the driver found beside the
        config file (``Config.found_modules``).
    """
    env = dict(runtime_env)
    shipped = [*env.get("py_modules", []), *found_modules]
    if shipped:
        env["py_modules"] = list(dict.fromkeys(shipped))
    return env or None


def theta_argument(theta: Any) -> Any:
    """What actor calls receive for ``theta``: itself when small, else the ref of one ``ray.put``."""
    nbytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(theta))
    return theta if nbytes <= INLINE_THETA_BYTES else ray.put(theta)


def _submit(supervisor: ActorSupervisor, rank: int, theta_arg: Any, version: int) -> None:
    # The call's tag is the theta version it computes on.
    supervisor.submit(rank, version, "compute", theta_arg, version)


def _count(counts: dict[int, int], rank: int) -> None:
    counts[rank] = counts.get(rank, 0) + 1


def starving_after(num_ranks: int, batch_size: int) -> int:
    """Learner updates without an accepted estimate after which an async rank is starving.

    When every rank keeps pace, one rank's accepted estimates are
    ``num_ranks / batch_size`` updates apart on average (at least one); a rank
    is starving after :data:`STARVING_SPACINGS` times that (rounded up).
    """
    return STARVING_SPACINGS * math.ceil(num_ranks / batch_size)


class SyncGather:
    """Sync rounds: one estimate per ready actor of this version, in rank order.

    Args:
      supervisor: the actors; each has ``compute(theta, version) -> Estimate``.
        If the supervisor has a ``compiled_method`` (``compute``), the round's
        first calls go through its compiled graph; a rank left without an
        estimate by it (a failure, a leftover call in flight) gets an
        ordinary call.
    """

    def __init__(self, supervisor: ActorSupervisor):
        self._supervisor = supervisor

    def gather(self, theta_arg: Any, version: int) -> Gathered:
        """One round on theta ``version`` (``theta_arg``: theta or its ObjectRef).

        Returns:
          The round's estimates in rank order, the ranks ``missing`` from it,
          and the leftovers of earlier rounds dropped as stale;
          ``restarted`` and ``lost_in_flight`` are left to the caller.
        """
        supervisor = self._supervisor
        dropped: dict[int, int] = {}
        supervisor.check_starting()
        # The round's actors: those ready now. A rank whose actor is lost stops
        # counting while its replacement starts, and counts again once ready.
        members = set(supervisor.ready_ranks)
        results: dict[int, Estimate] = (
            supervisor.call_compiled(sorted(members), theta_arg, version)
            if supervisor.compiled_method is not None
            else {}
        )
        while True:
            ready = set(supervisor.ready_ranks)
            if not results and not members & ready:
                # Nobody of the round is left: whoever is ready (now, or once
                # a replacement has started) joins it.
                members = ready
            pending = sorted(rank for rank in members & ready if rank not in results)
            if results and not pending:
                break
            for rank in pending:
                # Work for a rank without it: at the start, after a call that
                # brought nothing, or after a leftover of an earlier round came back.
                if supervisor.in_flight(rank) == 0:
                    _submit(supervisor, rank, theta_arg, version)
            reply = supervisor.next_reply()
            if reply is None:
                continue
            if reply.tag == version and reply.rank not in results:
                results[reply.rank] = reply.value
            else:
                _count(dropped, reply.rank)
        # A rank retired meanwhile (its node was lost) leaves its estimate out.
        live = supervisor.ranks
        estimates = [results[rank] for rank in sorted(results) if rank in live]
        missing = tuple(rank for rank in live if rank not in results)
        return Gathered(estimates, [0] * len(estimates), dropped, missing=missing)


class AsyncGather:
    """Async updates: ``batch_size`` estimates in completion order, staleness bounded.

    Args:
      supervisor: the actors; each has ``compute(theta, version) -> Estimate``.
      batch_size: estimates per update.
      max_staleness: the largest ``u - v`` accepted at learner version u for an
        estimate on version v, from ranks that are not starving.
      calls_in_flight: calls each ready actor keeps queued.
      starvation_guard: accept a starving rank's next reply whatever its
        staleness (see docs/population.md and :func:`starving_after`);
        False: every estimate beyond ``max_staleness`` is dropped, however
        long a rank starves.
    """

    def __init__(
        self,
        supervisor: ActorSupervisor,
        *,
        batch_size: int,
        max_staleness: int,
        calls_in_flight: int,
        starvation_guard: bool = True,
    ):
        self._supervisor = supervisor
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.calls_in_flight = calls_in_flight
        self.starvation_guard = starvation_guard
        # Rank -> the learner version at which it last had an estimate
        # accepted, or its actor was first given work.
        self._last_accepted: dict[int, int] = {}

    def _top_up(self, theta_arg: Any, version: int) -> None:
        supervisor = self._supervisor
        ready = supervisor.ready_ranks
        for rank in set(self._last_accepted) - set(ready):
            del self._last_accepted[rank]  # lost: its replacement starts a clock of its own
        for rank in ready:
            self._last_accepted.setdefault(rank, version)
            while supervisor.in_flight(rank) < self.calls_in_flight:
                _submit(supervisor, rank, theta_arg, version)

    def _starving(self, rank: int, version: int) -> bool:
        waited = version - self._last_accepted.get(rank, version)
        limit = starving_after(len(self._supervisor.ranks), self.batch_size)
        return self.starvation_guard and waited >= limit

    def gather(self, theta_arg: Any, version: int) -> Gathered:
        """Estimates for the update of learner version ``version`` (``theta_arg``: its theta).

        Returns:
          ``batch_size`` accepted estimates in completion order with their
          staleness, the drops per rank and the late acceptances per rank;
          ``restarted`` and ``lost_in_flight`` are left to the caller.
        """
        accepted: list[Estimate] = []
        staleness: list[int] = []
        dropped: dict[int, int] = {}
        late: dict[int, int] = {}
        self._top_up(theta_arg, version)
        while len(accepted) < self.batch_size:
            reply = self._supervisor.next_reply()
            # The finished actor (or one just ready) goes to work on the newest theta.
            self._top_up(theta_arg, version)
            if reply is None:
                continue
            stale = version - reply.tag
            if stale > self.max_staleness:
                if not self._starving(reply.rank, version):
                    _count(dropped, reply.rank)
                    continue
                _count(late, reply.rank)
            self._last_accepted[reply.rank] = version
            accepted.append(reply.value)
            staleness.append(stale)
        return Gathered(accepted, staleness, dropped, accepted_late=late)


def _with_cpu_devices(pc: PopulationConfig) -> dict[str, str]:
    """The user's actor environment, with ``XLA_FLAGS`` starting ``cpu_devices`` CPU devices.

    The flags build on the user's ``env`` (whose own device count the config
    checks against ``cpu_devices``), else on the driver's ``XLA_FLAGS``, which
    an embedded Ray's actors would otherwise inherit, less the driver's own
    device count: ``cpu_devices`` is the actors'.
    """
    env = dict(pc.env)
    if pc.cpu_devices is not None:
        if "XLA_FLAGS" in env:
            flags = env["XLA_FLAGS"]
        else:
            flags = without_host_devices(os.environ.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = with_host_devices(flags, pc.cpu_devices)
    return env


class RayPopulation:
    """``population.num_actors`` estimator actors (or one per node) on Ray.

    Args:
      population: how many actors, where, and in which mode.
      worker: what each actor builds its worker from.

    Raises:
      RuntimeError: Ray is not initialised in this process.
      ActorStartError, PopulationLostError, PlacementError: the actors
        cannot be built, placed or started (see
        :class:`~popmeta.population.supervisor.ActorSupervisor`).
    """

    def __init__(self, population: PopulationConfig, worker: WorkerSpec):
        if not ray.is_initialized():
            raise RuntimeError(
                "RayPopulation needs Ray running in this process; start it first with "
                "popmeta.population.ray_runtime.start_ray_for(population), e.g. "
                "`with start_ray_for(population): RayPopulation(population, worker)`"
            )
        pc = self._pc = population
        self._theta_arg: Any = None
        self._theta_version: int | None = None
        self._closed = False
        # True while a gather runs: an exception out of it leaves a sync round half done.
        self._mid_gather = False
        # Replacements and lost calls already reported by a gather; those of
        # the population's start go to the first one.
        self._reported_restarts = self._reported_lost = 0

        self._worker = worker
        # What a replacement is built from: the spec as it is now (calls sized).
        self._pickled_worker = ray.cloudpickle.dumps(worker)

        def actor_args(rank: int, restart: int, pin: tuple[int, ...] | None) -> tuple[Any, ...]:
            return self._pickled_worker, rank, restart, pin

        compiled_method = "compute" if pc.compiled_graph else None
        # Per actor only what Ray merges with the job's environment.
        env_vars = actor_env_vars(pc.num_gpus, _with_cpu_devices(pc))
        actor_env = {"env_vars": env_vars} if env_vars else None
        self._supervisor = ActorSupervisor(
            EstimatorActor, actor_args, pc, compiled_method, actor_env
        )
        self._policy: SyncGather | AsyncGather
        if pc.mode == "sync":
            self._policy = SyncGather(self._supervisor)
        else:
            self._policy = AsyncGather(
                self._supervisor,
                batch_size=pc.batch_size,
                max_staleness=pc.max_staleness,
                calls_in_flight=pc.calls_in_flight,
            )
            warning = staleness_warning(
                len(self._supervisor.ranks), pc.calls_in_flight, pc.batch_size, pc.max_staleness
            )
            if warning is not None:
                log.warning(warning)
        try:
            first = self._supervisor.describe()[0]
            self._steps_per_estimate = first.steps_per_estimate
        except BaseException:
            self.close()
            raise

    @property
    def num_live(self) -> int:
        """Actors serving a rank now (replacements still starting included)."""
        return len(self._supervisor.ranks)

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate (every task, antithetic member and truncation)."""
        return self._steps_per_estimate

    def gather(self, theta: Any, version: int) -> Gathered:
        """Estimates for the update that produces version ``version + 1``.

        Args:
          theta: theta of version ``version`` as host numpy arrays.
          version: the learner's version.

        Returns:
          Sync mode: one estimate per actor of the round, in rank order, and
          the ranks missing from it. Async mode: ``batch_size`` accepted
          estimates in completion order. Either way with their staleness, the
          estimates dropped as stale per rank, the actors replaced and the
          estimates lost in flight during this call.
        """
        if self._closed:
            raise RuntimeError("gather() on a closed RayPopulation")
        supervisor = self._supervisor
        # At most one put per version: repeated gathers of one version (a round
        # whose estimates were all unusable) reuse the ref. Compiled graphs take
        # theta by value; their rank's rare ordinary call then passes it as Ray does.
        if self._theta_version != version or self._theta_arg is None:
            self._theta_arg = theta if self._pc.compiled_graph else theta_argument(theta)
            self._theta_version = version
        self._mid_gather = True
        gathered = self._policy.gather(self._theta_arg, version)
        self._mid_gather = False
        restarts, lost = supervisor.num_restarts, supervisor.num_lost_calls
        gathered = gathered._replace(
            restarted=restarts - self._reported_restarts,
            lost_in_flight=lost - self._reported_lost,
        )
        self._reported_restarts, self._reported_lost = restarts, lost
        return gathered

    def throwaway_round(self, theta: Any, num_truncations: int) -> RoundCost | None:
        """Times a throwaway estimate of ``num_truncations`` on every ready actor at once.

        The per-call cost is the round's time beyond the slowest actor's
        compute: the theta put, the calls' round trips and the estimates' way
        back, as a sync round has them (see :mod:`popmeta.population.call_size`).
        None if an actor cannot run one or fails.
        """
        supervisor = self._supervisor
        start = time.perf_counter()
        theta_arg = theta_argument(theta)
        calls = {rank: (theta_arg, num_truncations) for rank in supervisor.ready_ranks}
        estimates, failed = supervisor.call_each("throwaway", calls)
        wall = time.perf_counter() - start
        if failed or not estimates or any(e is None for e in estimates.values()):
            return None
        computes = [estimate.metrics["compute_time_s"] for estimate in estimates.values()]
        return RoundCost(statistics.median(computes), max(0.0, wall - max(computes)))

    def use_truncations_per_call(self, num_truncations: int) -> None:
        """Every actor, and every replacement from now on, runs ``num_truncations`` per call.

        Each live actor compiles the new call before this returns. One that
        fails to is replaced by the next call that finds it lost, or keeps its
        old number (logged).
        """
        self._worker = self._worker.with_truncations_per_call(num_truncations)
        self._pickled_worker = ray.cloudpickle.dumps(self._worker)
        calls = {rank: (num_truncations,) for rank in self._supervisor.ranks}
        steps, failed = self._supervisor.call_each("use_truncations_per_call", calls)
        for rank, why in failed.items():
            log.warning(
                "actor %d did not take %d truncations per call: %s", rank, num_truncations, why
            )
        if steps:
            self._steps_per_estimate = next(iter(steps.values()))
        self._supervisor.reread_info()

    def export_worker_states(self) -> dict[int, WorkerState]:
        """Each ready actor's exported worker state, by rank (see the module's docstring).

        Sync mode: empty unless at a round boundary (a gather interrupted
        half-way, or calls in flight). Ranks whose actor has no state yet,
        fails or does not answer are absent (logged).
        """
        if self._closed:
            raise RuntimeError("export_worker_states() on a closed RayPopulation")
        supervisor = self._supervisor
        ranks = supervisor.ready_ranks
        if self._pc.mode == "sync" and (
            self._mid_gather or any(supervisor.in_flight(rank) for rank in ranks)
        ):
            return {}
        values, failed = supervisor.call_each("export_state", {rank: () for rank in ranks})
        for rank, why in failed.items():
            log.warning("actor %d: its worker state is not saved: %s", rank, why)
        return {rank: state for rank, state in sorted(values.items()) if state is not None}

    def load_worker_states(self, states: Mapping[int, WorkerState]) -> WorkerRestore:
        """Each live actor whose rank is in ``states`` continues from that state.

        Call it before the first :meth:`gather`. An actor whose state does not
        fit, or that fails, starts fresh; the reasons are in the result.
        """
        if self._closed:
            raise RuntimeError("load_worker_states() on a closed RayPopulation")
        live = self._supervisor.ranks
        calls = {rank: (states[rank],) for rank in live if rank in states}
        loaded, failed = self._supervisor.call_each("load_state", calls)
        fresh = {rank: "no saved state" for rank in live if rank not in states}
        fresh.update(failed)
        return WorkerRestore(
            tuple(sorted(loaded)),
            dict(sorted(fresh.items())),
            tuple(sorted(set(states) - set(live))),
        )

    def describe_actors(self) -> list[ActorInfo]:
        """Each live actor's :meth:`~popmeta.actors.actor.EstimatorActor.info`, in rank order.

        Waits for a replacement that has not reported yet.
        """
        return self._supervisor.describe()

    def close(self) -> None:
        """Kills the actors and releases their reservations (idempotent); Ray keeps running."""
        if self._closed:
            return
        self._closed = True
        self._theta_arg = None
        self._supervisor.close()

    def __enter__(self) -> RayPopulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
