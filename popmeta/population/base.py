"""What every population gives the learner loop."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from popmeta.learner.aggregation import Estimate

__all__ = ["Gathered", "Population"]


class Gathered(NamedTuple):
    """Estimates for one learner update, plus what happened while gathering them.

    Attributes:
      estimates: accepted estimates, in the order to aggregate them (sync mode:
        actor-rank order, which makes the update deterministic).
      staleness: per accepted estimate, learner version minus its theta version.
      dropped_stale: estimates dropped for exceeding ``max_staleness`` while gathering.
      restarted: actors replaced while gathering.
    """

    estimates: list[Estimate]
    staleness: list[int]
    dropped_stale: int = 0
    restarted: int = 0


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

    def close(self) -> None: ...
