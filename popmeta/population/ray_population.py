"""The Ray population: estimator actors on any node, fed by the learner.

:class:`RayPopulation` is the gather policy (sync or async) on top of an
:class:`~popmeta.population.supervisor.ActorSupervisor`, which owns the
actors: their placement, calls, deadlines and replacement.

Theta crosses to the actors once per version: one ``ray.put`` whose ObjectRef
every actor call for that version receives. Estimates come back by value.

* ``mode: sync`` -- each :meth:`RayPopulation.gather` asks every live actor for
  one estimate of this version and returns them in actor-rank order, so a run
  with a fixed seed is deterministic (and bitwise equal to the local engine).
  A reply on another version (a leftover of an interrupted earlier gather) is
  dropped and counted as stale.
* ``mode: async`` -- every actor keeps ``calls_in_flight`` calls queued, so it
  never idles waiting for theta, and no actor waits for another. The learner
  takes estimates in completion order; when a call finishes its actor is
  resubmitted at once with the newest theta. ``gather`` returns once
  ``batch_size`` estimates were accepted; one computed on version v is
  accepted at learner version u only if ``u - v <= max_staleness``, otherwise
  it is dropped and counted for its rank in ``Gathered.dropped_stale``.

A lost actor (dead, or no estimate within ``call_timeout_s``) is replaced by a
fresh one of the same rank and the next ``restart`` number: the actor derives
new keys from it, so its inner problems restart at new random offsets. Its
in-flight estimates are lost and the run goes on; the replacements of each
round are reported in ``Gathered.restarted``. After ``max_actor_restarts``
replacements ``gather`` raises ``RuntimeError``.

The population never starts or stops Ray: it uses the instance initialised in
this process (the run opens it with
:func:`~popmeta.population.ray_runtime.start_ray_for`).
"""

from __future__ import annotations

from typing import Any

import ray

from popmeta.actors.actor import EstimatorActor
from popmeta.config import Config
from popmeta.estimate import Estimate
from popmeta.population.base import Gathered
from popmeta.population.supervisor import ActorSupervisor

__all__ = ["RayPopulation"]


class RayPopulation:
    """``population.num_actors`` estimator actors (or one per node) on Ray.

    Args:
      config: the run's config; ``config.population`` says how many actors,
        where, and in which mode.

    Raises:
      RuntimeError: Ray is not initialised in this process, or the actors
        cannot be placed or started (see
        :class:`~popmeta.population.supervisor.ActorSupervisor`).
    """

    def __init__(self, config: Config):
        if not ray.is_initialized():
            raise RuntimeError(
                "RayPopulation needs Ray running in this process; start it first with "
                "popmeta.population.ray_runtime.start_ray_for(config.population), e.g. "
                "`with start_ray_for(config.population): RayPopulation(config)`"
            )
        self._pc = config.population
        self._theta_ref: Any = None
        self._theta_version: int | None = None
        self._closed = False

        def actor_args(rank: int, restart: int, pin: tuple[int, ...] | None) -> tuple[Any, ...]:
            return config, rank, restart, pin

        self._supervisor = ActorSupervisor(EstimatorActor, actor_args, config.population)
        try:
            first = self._supervisor.describe()[0]
            self._steps_per_estimate = int(first["steps_per_estimate"])
        except BaseException:
            self.close()
            raise

    @property
    def num_live(self) -> int:
        """Actors serving a rank now (replacements included)."""
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
          Sync mode: one estimate per live actor, in rank order. Async mode:
          ``batch_size`` accepted estimates in completion order. Either way
          with their staleness, the estimates dropped as stale per rank, and
          the actors replaced during this call.
        """
        if self._closed:
            raise RuntimeError("gather() on a closed RayPopulation")
        restarts_before = self._supervisor.num_restarts
        self._put_theta(theta, version)
        if self._pc.mode == "sync":
            estimates, staleness, dropped = self._gather_sync(version)
        else:
            estimates, staleness, dropped = self._gather_async(version)
        restarted = self._supervisor.num_restarts - restarts_before
        return Gathered(estimates, staleness, dropped, restarted)

    def describe_actors(self) -> list[dict[str, Any]]:
        """Each live actor's :meth:`~popmeta.actors.actor.EstimatorActor.info`, in rank order.

        Among others ``rank``, ``restart``, ``node_id``, ``pid`` and
        ``pinned_cores``; waits for a replacement that has not reported yet.
        """
        return self._supervisor.describe()

    def close(self) -> None:
        """Kills the actors and releases their reservations (idempotent); Ray keeps running."""
        if self._closed:
            return
        self._closed = True
        self._theta_ref = None
        self._supervisor.close()

    def __enter__(self) -> RayPopulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ policies

    def _put_theta(self, theta: Any, version: int) -> None:
        # One put per version: repeated gathers of one version (a round whose
        # estimates were all unusable) reuse the ref.
        if self._theta_version != version or self._theta_ref is None:
            self._theta_ref = ray.put(theta)
            self._theta_version = version

    def _submit(self, rank: int) -> None:
        # The call's tag is the theta version it computes on.
        self._supervisor.submit(
            rank, self._theta_version, "compute", self._theta_ref, self._theta_version
        )

    def _gather_sync(self, version: int) -> tuple[list[Estimate], list[int], dict[int, int]]:
        supervisor = self._supervisor
        results: dict[int, Estimate] = {}
        dropped: dict[int, int] = {}

        def feed() -> None:
            # A rank without a result and without work gets this version: at
            # the start, after a replacement, after a call that brought
            # nothing, or after a leftover of an interrupted gather came back.
            for rank in supervisor.ranks:
                if rank not in results and supervisor.in_flight(rank) == 0:
                    self._submit(rank)

        feed()
        while any(rank not in results for rank in supervisor.ranks):
            reply = supervisor.next_reply()
            if reply is not None:
                if reply.tag == version and reply.rank not in results:
                    results[reply.rank] = reply.value
                else:
                    dropped[reply.rank] = dropped.get(reply.rank, 0) + 1
            feed()
        # A rank retired meanwhile (its node was lost) leaves its estimate out.
        live = set(supervisor.ranks)
        estimates = [results[rank] for rank in sorted(results) if rank in live]
        return estimates, [0] * len(estimates), dropped

    def _top_up(self) -> None:
        for rank in self._supervisor.ranks:
            while self._supervisor.in_flight(rank) < self._pc.calls_in_flight:
                self._submit(rank)

    def _gather_async(self, version: int) -> tuple[list[Estimate], list[int], dict[int, int]]:
        accepted: list[Estimate] = []
        staleness: list[int] = []
        dropped: dict[int, int] = {}
        self._top_up()
        while len(accepted) < self._pc.batch_size:
            reply = self._supervisor.next_reply()
            # The finished actor goes straight back to work on the newest theta.
            self._top_up()
            if reply is None:
                continue
            stale = version - reply.tag
            if stale > self._pc.max_staleness:
                dropped[reply.rank] = dropped.get(reply.rank, 0) + 1
                continue
            accepted.append(reply.value)
            staleness.append(stale)
        return accepted, staleness, dropped
