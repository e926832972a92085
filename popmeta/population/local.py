"""The in-process population: every worker runs in the driver, one after another."""

from __future__ import annotations

from typing import Any

from popmeta.actors.worker import EstimatorWorker
from popmeta.config import Config
from popmeta.population.base import Gathered

__all__ = ["LocalPopulation"]


class LocalPopulation:
    """``population.num_actors`` workers with ranks 0..N-1, run in rank order (sync mode)."""

    def __init__(self, config: Config):
        self.workers = [
            EstimatorWorker(config, rank) for rank in range(config.population.num_actors)
        ]

    @property
    def num_live(self) -> int:
        return len(self.workers)

    @property
    def steps_per_estimate(self) -> int:
        return self.workers[0].steps_per_estimate

    def gather(self, theta: Any, version: int) -> Gathered:
        estimates = [worker.compute(theta, version) for worker in self.workers]
        return Gathered(estimates, [0] * len(estimates))

    def close(self) -> None:
        self.workers = []
