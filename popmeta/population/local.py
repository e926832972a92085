"""The in-process population: every worker runs in the driver, one after another."""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Mapping
from typing import Any

from popmeta.actors.records import ActorInfo, WorkerState
from popmeta.actors.worker import EstimatorWorker
from popmeta.config import PopulationConfig
from popmeta.experiment import WorkerSpec
from popmeta.learner.learner import Learner
from popmeta.population.base import Gathered, WorkerRestore
from popmeta.population.call_size import RoundCost
from popmeta.population.fused import FusedRounds

__all__ = ["LocalPopulation"]


class LocalPopulation:
    """``population.num_actors`` workers with ranks 0..N-1, run in rank order (sync mode).

    Nothing is ever stale, dropped or replaced: every :meth:`gather` returns one
    estimate per worker on the version asked for.

    Args:
      population: how many workers (``num_actors``; the run loop reads ``updates_per_call``).
      worker: what each worker is built from.
    """

    def __init__(self, population: PopulationConfig, worker: WorkerSpec):
        self.workers = [EstimatorWorker(worker, rank) for rank in range(population.num_actors)]
        # True while a gather runs: an exception out of it (Ctrl-C) leaves the
        # workers before it one call ahead of the others.
        self._mid_gather = False

    @property
    def num_live(self) -> int:
        return len(self.workers)

    @property
    def steps_per_estimate(self) -> int:
        return self.workers[0].steps_per_estimate

    def gather(self, theta: Any, version: int) -> Gathered:
        self._mid_gather = True
        estimates = [worker.compute(theta, version) for worker in self.workers]
        self._mid_gather = False
        return Gathered(estimates, [0] * len(estimates), {}, 0)

    def fused_rounds(self, learner: Learner, max_rounds: int) -> FusedRounds:
        """The workers and ``learner``'s step as one program of up to ``max_rounds`` rounds.

        Raises:
          ValueError: a worker cannot run fused (see :class:`FusedRounds`).
        """
        return FusedRounds(self.workers, learner, max_rounds)

    def throwaway_round(self, theta: Any, num_truncations: int) -> RoundCost | None:
        """Times a throwaway estimate of ``num_truncations`` on every worker, one after another.

        The per-call cost is the round's time beyond the workers' compute,
        shared among them (see :mod:`popmeta.population.call_size`).
        """
        start = time.perf_counter()
        estimates = [worker.throwaway(num_truncations, theta, keep=True) for worker in self.workers]
        wall = time.perf_counter() - start
        if any(estimate is None for estimate in estimates):
            return None
        computes = [estimate.metrics["compute_time_s"] for estimate in estimates]
        overhead = max(0.0, wall - sum(computes)) / len(computes)
        return RoundCost(statistics.median(computes), overhead)

    def use_truncations_per_call(self, num_truncations: int) -> None:
        """Every worker runs ``num_truncations`` truncations per call from now on."""
        for worker in self.workers:
            worker.use_truncations_per_call(num_truncations)

    def export_worker_states(self) -> dict[int, WorkerState]:
        """Each worker's exported state by rank; empty after a gather that did not complete."""
        if self._mid_gather:
            return {}
        states = {worker.rank: worker.export_state() for worker in self.workers}
        return {rank: state for rank, state in states.items() if state is not None}

    def load_worker_states(self, states: Mapping[int, WorkerState]) -> WorkerRestore:
        """Loads each rank's state into its worker; see :class:`WorkerRestore`."""
        restored, fresh = [], {}
        for worker in self.workers:
            if worker.rank not in states:
                fresh[worker.rank] = "no saved state"
                continue
            try:
                worker.load_state(states[worker.rank])
            except ValueError as err:
                fresh[worker.rank] = str(err)
            else:
                restored.append(worker.rank)
        ranks = {worker.rank for worker in self.workers}
        return WorkerRestore(tuple(restored), fresh, tuple(sorted(set(states) - ranks)))

    def describe_actors(self) -> list[ActorInfo]:
        """Each worker, in rank order: all in this process (``node_id`` ``"local"``), unpinned."""
        return [
            ActorInfo(
                rank=worker.rank,
                restart=0,
                node_id="local",
                hostname=socket.gethostname(),
                pid=os.getpid(),
                pinned_cores=None,
                num_devices=int(worker.num_devices),
                num_tasks=int(worker.num_tasks),
                steps_per_estimate=int(worker.steps_per_estimate),
            )
            for worker in self.workers
        ]

    def close(self) -> None:
        self.workers = []
