"""TensorBoard summaries written with tensorboardX, and the statistics behind them."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter

from popmeta.estimate import Aggregate
from popmeta.population.base import Gathered

__all__ = ["RoundStats", "Summaries"]


class Summaries:
    """Summaries under ``run_dir``; ``close()`` drains the writer's queue."""

    def __init__(self, run_dir: str | Path, flush_secs: int = 5):
        self._writer = SummaryWriter(str(run_dir), flush_secs=flush_secs)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, float(value), step)

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        self._writer.add_histogram(name, np.asarray(values, np.float64), step)

    def close(self) -> None:
        self._writer.close()


class RoundStats:
    """Accumulates what happens between two summary writes.

    Rates (estimates/s, inner-steps/s) are measured over the whole window, so
    they include gathering, aggregation and the update; counts of dropped,
    rejected, missing (ranks absent from a sync round), lost in flight,
    accepted late (the async starvation guard) and restarted are totals since
    the run (re)started, overall and (for drops, missing and late) per actor
    rank. The ``trajectory_phase`` histogram pools every
    actor's latest task phases: a population in lockstep shows one spike, a
    decorrelated one a flat histogram.
    """

    def __init__(self, steps_per_estimate: int, task_family: str):
        self.steps_per_estimate = steps_per_estimate
        self.task_family = task_family
        self.dropped_stale_by_actor: dict[int, int] = defaultdict(int)
        self.missing_by_actor: dict[int, int] = defaultdict(int)
        self.accepted_late_by_actor: dict[int, int] = defaultdict(int)
        self.lost_in_flight = 0
        self.rejected_nonfinite = 0
        self.restarts = 0
        self.last_estimates_per_s = 0.0
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()
        self._num_estimates = 0
        self._losses: list[float] = []
        self._staleness: list[int] = []
        self._update_times: list[float] = []
        self._norms: dict[str, list[float]] = defaultdict(list)
        self._actor_time: dict[int, float] = defaultdict(float)
        self._actor_count: dict[int, int] = defaultdict(int)
        self._phases: dict[int, np.ndarray] = {}

    def add_round(self, gathered: Gathered, agg: Aggregate) -> None:
        self._num_estimates += len(gathered.estimates)
        self._staleness.extend(gathered.staleness)
        for rank, dropped in gathered.dropped_stale.items():
            self.dropped_stale_by_actor[rank] += dropped
        for rank in gathered.missing:
            self.missing_by_actor[rank] += 1
        for rank, late in gathered.accepted_late.items():
            self.accepted_late_by_actor[rank] += late
        self.lost_in_flight += gathered.lost_in_flight
        self.restarts += gathered.restarted
        self.rejected_nonfinite += agg.num_rejected_nonfinite
        if agg.grad is not None:
            self._losses.append(agg.mean_loss)
        for estimate in gathered.estimates:
            self._actor_time[estimate.worker] += estimate.metrics.get("compute_time_s", 0.0)
            self._actor_count[estimate.worker] += 1
            if estimate.phases is not None:
                self._phases[estimate.worker] = estimate.phases

    def add_update(self, seconds: float, norms: Mapping[str, float]) -> None:
        self._update_times.append(seconds)
        for name, value in norms.items():
            self._norms[name].append(value)

    def write(self, summaries: Summaries, step: int, live_actors: int) -> None:
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        self.last_estimates_per_s = self._num_estimates / elapsed
        meta_loss = np.mean(self._losses) if self._losses else float("nan")
        values = {
            "meta_loss": meta_loss,
            f"meta_loss_by_family/{self.task_family}": meta_loss,
            "learner_update_time": np.mean(self._update_times) if self._update_times else 0.0,
            "estimates_per_s": self.last_estimates_per_s,
            "inner_steps_per_s": self.last_estimates_per_s * self.steps_per_estimate,
            "dropped_stale": sum(self.dropped_stale_by_actor.values()),
            "missing_estimates": sum(self.missing_by_actor.values()),
            "lost_in_flight": self.lost_in_flight,
            "accepted_late": sum(self.accepted_late_by_actor.values()),
            "rejected_nonfinite": self.rejected_nonfinite,
            "actor_restarts": self.restarts,
            "live_actors": live_actors,
        }
        names = {"param_norm": "theta_norm"}
        for name, series in self._norms.items():
            values[names.get(name, name)] = np.mean(series)
        if self._staleness:
            values["staleness_mean"] = np.mean(self._staleness)
            values["staleness_max"] = np.max(self._staleness)
            summaries.histogram(step, "staleness", np.asarray(self._staleness))
        for rank, dropped in self.dropped_stale_by_actor.items():
            values[f"dropped_stale_by_actor/{rank}"] = dropped
        for rank, missing in self.missing_by_actor.items():
            values[f"missing_by_actor/{rank}"] = missing
        for rank, late in self.accepted_late_by_actor.items():
            values[f"accepted_late_by_actor/{rank}"] = late
        if self._phases:
            phases = np.concatenate([self._phases[rank] for rank in sorted(self._phases)])
            summaries.histogram(step, "trajectory_phase", phases)
        for worker, seconds in self._actor_time.items():
            if seconds > 0:
                rate = self._actor_count[worker] * self.steps_per_estimate / seconds
                values[f"inner_steps_per_s_by_actor/{worker}"] = rate
        summaries.scalars(step, values)
        self._reset_window()
