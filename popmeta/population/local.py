"""The in-process population: every worker runs in the driver, one after another."""

from __future__ import annotations

import os
import socket
from typing import Any

from popmeta.actors.worker import EstimatorWorker
from popmeta.config import Config
from popmeta.population.base import Gathered

__all__ = ["LocalPopulation"]


class LocalPopulation:
    """``population.num_actors`` workers with ranks 0..N-1, run in rank order (sync mode).

    Nothing is ever stale, dropped or replaced: every :meth:`gather` returns one
    estimate per worker on the version asked for.
    """

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
        return Gathered(estimates, [0] * len(estimates), {}, 0)

    def describe_actors(self) -> list[dict[str, Any]]:
        """Each worker, in rank order: all in this process (``node_id`` ``"local"``), unpinned."""
        return [
            {
                "rank": worker.rank,
                "restart": 0,
                "node_id": "local",
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "pinned_cores": None,
                "num_devices": int(worker.num_devices),
                "num_tasks": int(worker.num_tasks),
                "steps_per_estimate": int(worker.steps_per_estimate),
            }
            for worker in self.workers
        ]

    def close(self) -> None:
        self.workers = []
