"""What every population gives the run loop."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from popmeta.actors.records import ActorInfo, WorkerState
from popmeta.estimate import Estimate
from popmeta.population.call_size import RoundCost

__all__ = ["Gathered", "Population", "WorkerRestore"]


class Gathered(NamedTuple):
    """Estimates for one learner update, plus what happened while gathering them.

    Attributes:
      estimates: accepted estimates, in the order to aggregate them (sync mode:
        actor-rank order, which makes the update deterministic).
      staleness: per accepted estimate, learner version minus its theta version.
      dropped_stale: rank -> estimates of that rank dropped while gathering
        (too stale for ``max_staleness``, or a leftover of an earlier sync
        round); ranks without drops are absent.
      restarted: actors replaced while gathering.
      missing: sync mode: ranks without an estimate in this round, in order
        (their actor was lost during the round, or is a replacement still
        starting); empty in async mode, which has no rounds.
      lost_in_flight: estimates lost with their actor while gathering (calls
        in flight when it died or passed its deadline).
      accepted_late: async mode: rank -> estimates of that rank accepted
        beyond ``max_staleness`` because the rank was starving (its estimates
        are included in ``estimates`` and their staleness in ``staleness``);
        ranks without such estimates are absent.
    """

    estimates: list[Estimate]
    staleness: list[int]
    dropped_stale: Mapping[int, int]
    restarted: int = 0
    missing: tuple[int, ...] = ()
    lost_in_flight: int = 0
    accepted_late: Mapping[int, int] = MappingProxyType({})


class WorkerRestore(NamedTuple):
    """What :meth:`Population.load_worker_states` did.

    Attributes:
      restored: ranks whose worker continues from its saved state, in order.
      fresh: rank -> why its worker starts afresh (no saved state, the state
        does not fit the config, the actor did not answer); live ranks only.
      unused: saved ranks that no live worker serves, in order.
    """

    restored: tuple[int, ...]
    fresh: Mapping[int, str]
    unused: tuple[int, ...]


class Population(Protocol):
    """A set of estimator workers that turn theta into gradient estimates."""

    @property
    def num_live(self) -> int: ...

    @property
    def steps_per_estimate(self) -> int:
        """Inner steps behind one estimate (every task and antithetic member)."""
        ...

    def gather(self, theta: Any, version: int) -> Gathered:
        """Estimates for the update that produces version ``version + 1``."""
        ...

    def describe_actors(self) -> list[ActorInfo]:
        """Where each live worker runs, in rank order."""
        ...

    def throwaway_round(self, theta: Any, num_truncations: int) -> RoundCost | None:
        """One round of throwaway estimates of ``num_truncations`` on the workers, timed.

        Throwaway estimates leave every worker's estimates as they were (see
        :meth:`~popmeta.actors.worker.EstimatorWorker.throwaway`). None where the
        workers cannot run one.
        """
        ...

    def use_truncations_per_call(self, num_truncations: int) -> None:
        """Every worker, and any that replaces one, runs ``num_truncations`` per call."""
        ...

    def export_worker_states(self) -> dict[int, WorkerState]:
        """Each worker's exported state, by rank, at the end of the last gather.

        See :meth:`~popmeta.actors.worker.EstimatorWorker.export_state`. Sync
        mode: empty unless the population is at a round boundary (a gather
        interrupted half-way leaves some workers a call ahead). Ranks without
        a state yet are absent.
        """
        ...

    def load_worker_states(self, states: Mapping[int, WorkerState]) -> WorkerRestore:
        """Makes each live worker whose rank is in ``states`` continue from that state.

        Call it before the first :meth:`gather`. A state that does not fit
        leaves its worker fresh; nothing raises for it.
        """
        ...

    def close(self) -> None: ...
