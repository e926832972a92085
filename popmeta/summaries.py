"""TensorBoard summaries, written synchronously, and the statistics behind them.

Event files are written here rather than with ``tensorboardX.SummaryWriter``,
whose background thread dies on a failed write and then blocks the run
(docs/ray.md, "TensorBoard"). Here each call of :meth:`Summaries.scalars` or
:meth:`Summaries.histogram` is one TFRecord written in the calling thread
with one unbuffered ``write``: an event is in the kernel once the call
returns, and a failure is an ``OSError`` handled here. Summaries are never
worth a run: on the first failed write they warn once and switch themselves
off, while the run goes on. TFRecord framing, as TensorBoard reads it: the
payload length as a little-endian uint64, the masked CRC-32C of those 8
bytes (uint32), the serialized ``Event`` proto, and the masked CRC-32C of
the payload.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.summary import histogram as histogram_summary

from popmeta.core.estimators import FAMILY_LOSS_METRIC
from popmeta.estimate import Aggregate
from popmeta.population.base import Gathered

__all__ = ["RoundStats", "Summaries", "scalar_leaves"]

log = logging.getLogger("popmeta")

#: Equal-width buckets per histogram; the histograms here are of small ranges
#: (staleness counts, trajectory phases in [0, 1]).
HISTOGRAM_BINS = 30

# Two writers opened in one second by one process (e.g. evaluation curves)
# still get distinct files.
_file_numbers = itertools.count()


def _record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


def scalar_leaves(tree: Any, prefix: str) -> dict[str, float]:
    """Every scalar leaf of ``tree`` by its path under ``prefix`` (``theta/log_lr``).

    A learned optimizer's scalar meta-parameters (a base step size, a
    momentum, a fan-in power) are what a user watches meta-training move;
    its arrays are summarized by ``theta_norm`` instead.
    """
    return {
        f"{prefix}/{jax.tree_util.keystr(path, simple=True, separator='/')}": float(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if np.ndim(leaf) == 0
    }


class Summaries:
    """One TensorBoard event file under ``run_dir``, written synchronously.

    A write that fails (``OSError``: no space, read-only, I/O error) logs one
    warning naming the file and the error, cuts the file back to its last
    complete event (where the disk still allows it) and turns every later call
    into a no-op; :attr:`failure` then says what happened. No method raises
    ``OSError``.

    Args:
      run_dir: the directory of the event file (created if missing).
    """

    def __init__(self, run_dir: str | Path):
        self.failure: str | None = None
        self._file = None
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_file_numbers)}"
        )
        self.path = Path(run_dir) / name
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write either reaches the kernel before the call
            # returns or raises here, never later from a flush.
            self._file = open(self.path, "xb", buffering=0)  # noqa: SIM115 -- closed in close()
        except OSError as err:
            self._fail(err)
            return
        self._size = 0
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes ``values`` (tag -> number) as one event at ``step``."""
        summary = Summary(
            value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()]
        )
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        """Writes a histogram of the finite entries of ``values`` (nothing if there are none)."""
        values = np.asarray(values, np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size == 0:
            return
        summary = histogram_summary(name, values, bins=HISTOGRAM_BINS)
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        """Closes the event file; a failure to close is reported like a failed write."""
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.close()
        except OSError as err:
            self._fail(err)

    def _write(self, event: Event) -> None:
        if self._file is None:
            return
        record = _record(event.SerializeToString())
        data = memoryview(record)
        try:
            while data:
                # A raw write may be short (e.g. the disk filled up mid-way);
                # the next one then raises.
                written = self._file.write(data)
                data = data[written:]
        except OSError as err:
            self._abandon(err)
            return
        self._size += len(record)

    def _abandon(self, err: OSError) -> None:
        file, self._file = self._file, None
        # A partial record at the end would make readers stop with an error;
        # truncating frees space, so it can work even on a full disk.
        with contextlib.suppress(OSError):
            file.truncate(self._size)
        with contextlib.suppress(OSError):
            file.close()
        self._fail(err)

    def _fail(self, err: OSError) -> None:
        reason = err.strerror or str(err)
        self.failure = f"{self.path}: {reason} (errno {err.errno})"
        log.warning(
            "cannot write TensorBoard events to %s (%s); the run goes on without summaries "
            "and keeps writing its checkpoints. Free space or fix the permissions there to "
            "have summaries again after a resume.",
            self.path,
            reason,
        )


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

    Args:
      steps_per_estimate: inner steps behind one estimate.
      truncations_per_call: truncations behind one estimate (written as a
        scalar: ``auto`` chose it at the start).
      task_family: the family the meta-loss is reported under when the
        estimates carry no per-family losses.
      actors: the workers are actors (the Ray engine): staleness, drops,
        missing estimates, losses and restarts are written; the local engine
        has none of them.
    """

    def __init__(
        self,
        steps_per_estimate: int,
        truncations_per_call: int,
        task_family: str,
        actors: bool = True,
    ):
        self.steps_per_estimate = steps_per_estimate
        self.truncations_per_call = truncations_per_call
        self.task_family = task_family
        self.actors = actors
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
        self._family_losses: dict[str, list[float]] = defaultdict(list)
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
        if agg.num_used:
            self._losses.append(agg.mean_loss)
            for family, loss in agg.family_losses.items():
                self._family_losses[family].append(loss)
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
            "learner_update_time": np.mean(self._update_times) if self._update_times else 0.0,
            "estimates_per_s": self.last_estimates_per_s,
            "inner_steps_per_s": self.last_estimates_per_s * self.steps_per_estimate,
            "truncations_per_call": self.truncations_per_call,
            "rejected_nonfinite": self.rejected_nonfinite,
        }
        if self.actors:
            values |= {
                "dropped_stale": sum(self.dropped_stale_by_actor.values()),
                "missing_estimates": sum(self.missing_by_actor.values()),
                "lost_in_flight": self.lost_in_flight,
                "accepted_late": sum(self.accepted_late_by_actor.values()),
                "actor_restarts": self.restarts,
                "live_actors": live_actors,
            }
        # A mixture's estimates carry each family's loss; a single family's is the meta-loss.
        by_family = {f: np.mean(losses) for f, losses in self._family_losses.items()}
        for family, loss in (by_family or {self.task_family: meta_loss}).items():
            values[f"{FAMILY_LOSS_METRIC}{family}"] = loss
        names = {"param_norm": "theta_norm"}
        for name, series in self._norms.items():
            values[names.get(name, name)] = np.mean(series)
        if self._staleness and self.actors:
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
