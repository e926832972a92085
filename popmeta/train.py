"""The meta-training loop: gather estimates, aggregate, update theta, log, checkpoint.

This is the top of the run: it owns the population (and, for the Ray engine,
the Ray runtime it needs), the learner, the TensorBoard summaries and the
checkpoints, and it closes them in an order that keeps the run directory
consistent whatever fails: the final checkpoint is written first, then the
event files are closed, then the population and finally Ray are shut down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from popmeta.config import Config, ConfigError, config_to_dict
from popmeta.estimate import aggregate
from popmeta.evaluate import EvalResult, evaluate_thetas
from popmeta.experiment import build_task_family, initial_theta
from popmeta.learner.checkpoints import (
    list_checkpoints,
    load_checkpoint,
    restore_latest,
    save_checkpoint,
)
from popmeta.learner.learner import Learner
from popmeta.population.base import Population
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation
from popmeta.population.ray_runtime import start_ray_for
from popmeta.run_dir import RunDirectory, RunDirectoryError
from popmeta.summaries import RoundStats, Summaries

__all__ = ["DivergedError", "RunResult", "open_population", "train"]

log = logging.getLogger("popmeta")

#: Consecutive rounds with no usable estimate after which the run stops.
MAX_FAILED_ROUNDS = 20


class DivergedError(RuntimeError):
    """No finite estimate for ``MAX_FAILED_ROUNDS`` rounds in a row; theta was left unchanged."""


def _diverged(failures: int, step: int, run: RunDirectory) -> str:
    checkpoints = list_checkpoints(run.checkpoints)
    listing = ", ".join(path.name for path in checkpoints) or "none yet"
    # The newest holds the theta whose estimates are all non-finite: suggest the one before.
    start = checkpoints[-2] if len(checkpoints) > 1 else (checkpoints or [None])[-1]
    how = (
        f" To go on from an earlier one with a change (e.g. a smaller "
        f"outer_optimizer.learning_rate): popmeta train CONFIG --from-checkpoint {start} "
        "--set ...; or start afresh with --set name=NEW."
        if start is not None
        else " Start afresh with --set name=NEW and, e.g., a smaller outer_optimizer.learning_rate."
    )
    return (
        f"{failures} rounds in a row without a finite estimate at step {step}: every estimate "
        f"was non-finite (counted as rejected_nonfinite in TensorBoard) and theta was left "
        f"unchanged. Checkpoints of {run.path}: {listing}.{how}"
    )


class _StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the current step; a second SIGINT at once.

    A flag read between steps cannot be lost in the middle of a blocking Ray or
    XLA call the way a KeyboardInterrupt raised there can, and the run ends
    with a checkpoint of a complete step. Python runs signal handlers in the
    main thread only, so elsewhere (a run started from a worker thread) the
    process keeps its handlers.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class RunResult(NamedTuple):
    """What a call of :func:`train` did.

    Attributes:
      run_dir: the run directory.
      final_step: the learner step the run ended at.
      meta_loss_start: mean meta-loss over the first tenth of this call's updates.
      meta_loss_end: mean meta-loss over the last tenth.
      evaluation: the trained and untrained learned optimizers on held-out
        tasks (empty when interrupted or already finished).
      interrupted: Ctrl-C or SIGTERM stopped the run (a checkpoint was written).
      already_finished: the run had reached ``train.num_steps`` before this
        call, which then started nothing.
    """

    run_dir: Path
    final_step: int
    meta_loss_start: float
    meta_loss_end: float
    evaluation: dict[str, EvalResult]
    interrupted: bool
    already_finished: bool = False


class _Progress:
    """A tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, initial: int, every: int, stream=None):
        self.stream = stream or sys.stderr
        self.every = max(every, 1)
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, file=self.stream, unit="step", dynamic_ncols=True
            )

    def update(self, step: int, total: int, fields: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == total:
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"step {step}/{total} {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


PopulationFactory = Callable[[Config], Population]


@contextlib.contextmanager
def open_population(
    config: Config, factory: PopulationFactory | None = None
) -> Iterator[Population]:
    """The population of ``config`` with the runtime it needs, closed on exit.

    Args:
      config: the run's config; ``population.engine`` picks the population.
      factory: builds the population instead; the caller then owns whatever
        runtime it needs (e.g. a Ray instance a test session started).

    Yields:
      The population. On exit it is closed, and then the Ray instance this
      function started (an embedded one; a joined cluster is left running).
    """
    if factory is not None:
        runtime: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    elif config.population.engine == "local":
        runtime, factory = contextlib.nullcontext(), LocalPopulation
    else:
        runtime, factory = start_ray_for(config.population), RayPopulation
    with runtime:
        population = factory(config)
        try:
            yield population
        finally:
            population.close()


def _placement(actors: list[dict[str, Any]]) -> str:
    nodes = {actor["node_id"] for actor in actors}
    text = f"{len(actors)} actor(s) on {len(nodes)} node(s)"
    pinned = [actor.get("pinned_cores") for actor in actors]
    if any(pinned):
        text += ", pinned to cores " + " ".join(str(cores) for cores in pinned)
    return text


def train(
    config: Config,
    population_factory: PopulationFactory | None = None,
    stream=None,
    from_checkpoint: str | Path | None = None,
) -> RunResult:
    """Meta-trains theta for ``config.train.num_steps`` outer steps, resuming if possible.

    Writes ``config.yaml``, TensorBoard events and checkpoints under
    ``run_dir/name``. Ctrl-C stops after the current step, saves a checkpoint
    and closes the event files (so does SIGTERM, e.g. from a scheduler that
    preempts the job): the run directory stays consistent.

    Args:
      config: the run's config.
      population_factory: builds the population; by default the one
        ``population.engine`` names, with the runtime it needs (see
        :func:`open_population`).
      stream: where progress lines go (default stdout).
      from_checkpoint: a checkpoint file to start from instead of the run's
        newest one; the run then takes the new config (see
        :meth:`~popmeta.run_dir.RunDirectory.take_over_from`).

    Raises:
      ConfigError: a data file the config names is missing or malformed.
      RunDirectoryError: the run directory holds another experiment, is in use
        by a live run, cannot be written, or its checkpoint does not fit.
    """
    stream = stream or sys.stdout
    run = RunDirectory(config)
    run.check_writable()
    _check_task_data(config)
    with run.claim():
        if from_checkpoint is None:
            run.check_identity()
        else:
            run.take_over_from(Path(from_checkpoint))
        learner = Learner(config)
        _restore(learner, run, from_checkpoint, stream)
        if learner.version >= config.train.num_steps:
            print(
                f"{run.path} already finished: step {learner.version} of "
                f"train.num_steps={config.train.num_steps}; raise train.num_steps to train "
                "further, or start a new run with --set name=NEW",
                file=stream,
            )
            return RunResult(run.path, learner.version, math.nan, math.nan, {}, False, True)
        return _train(config, run, learner, population_factory, stream)


def _check_task_data(config: Config) -> None:
    """Builds the task family once in the driver: data files fail here, before any actor starts."""
    try:
        build_task_family(config.task)
    except (OSError, ValueError) as err:
        field = "task.npz_path" if config.task.npz_path is not None else "task.family"
        raise ConfigError(f"{field}: {err}") from None


def _restore(
    learner: Learner, run: RunDirectory, from_checkpoint: str | Path | None, stream
) -> None:
    """Restores the learner from ``from_checkpoint``, else from the run's newest checkpoint."""
    target = learner.checkpoint_tree()
    try:
        if from_checkpoint is not None:
            restored = load_checkpoint(from_checkpoint, target)
        else:
            restored = restore_latest(run.checkpoints, target)
    except ValueError as err:
        raise RunDirectoryError(
            f"{err}. The checkpoint does not fit learned_optimizer.kind="
            f"{run.config.learned_optimizer.kind!r} as configured; start a new run with "
            "--set name=NEW"
        ) from None
    if restored is not None:
        learner.restore(restored.tree)
        print(f"resumed from {restored.path} at step {learner.version}", file=stream)


def _train(
    config: Config,
    run: RunDirectory,
    learner: Learner,
    population_factory: PopulationFactory | None,
    stream,
) -> RunResult:
    run_dir, ckpt_dir = run.path, run.checkpoints
    tcfg = config.train
    meta_losses: list[float] = []
    interrupted = False
    failures = 0

    def checkpoint():
        save_checkpoint(
            ckpt_dir,
            learner.version,
            learner.checkpoint_tree(),
            keep=tcfg.keep_checkpoints,
            metadata={"config": config_to_dict(config)},
        )

    # Closed last-in first-out: the progress bar, the event files, then the
    # population and its runtime. The final checkpoint comes before all of them.
    with contextlib.ExitStack() as closing:
        population = closing.enter_context(open_population(config, population_factory))
        print(_placement(population.describe_actors()), file=stream)
        run.record_config()
        summaries = Summaries(run_dir)
        closing.callback(summaries.close)
        stats = RoundStats(population.steps_per_estimate, config.task.family)
        progress = _Progress(tcfg.num_steps, learner.version, tcfg.log_every)
        closing.callback(progress.close)
        stop = closing.enter_context(_StopSignals())
        try:
            while learner.version < tcfg.num_steps and stop.received is None:
                gathered = population.gather(learner.theta(), learner.version)
                agg = aggregate(gathered.estimates)
                stats.add_round(gathered, agg)
                if agg.grad is None:
                    failures += 1
                    log.warning(
                        "step %d: no usable estimate (%d non-finite); theta unchanged",
                        learner.version,
                        agg.num_rejected_nonfinite,
                    )
                    if failures >= MAX_FAILED_ROUNDS:
                        stats.write(summaries, learner.version, population.num_live)
                        raise DivergedError(_diverged(failures, learner.version, run))
                    continue
                failures = 0
                update_start = time.perf_counter()
                norms = learner.apply(agg)
                stats.add_update(time.perf_counter() - update_start, norms)
                step = learner.version
                meta_losses.append(agg.mean_loss)
                if step % tcfg.summary_every == 0 or step == tcfg.num_steps:
                    stats.write(summaries, step, population.num_live)
                if step % tcfg.checkpoint_every == 0:
                    checkpoint()
                progress.update(
                    step,
                    tcfg.num_steps,
                    {
                        "meta_loss": f"{agg.mean_loss:.4f}",
                        "est/s": f"{stats.last_estimates_per_s:.1f}",
                        "actors": str(population.num_live),
                    },
                )
        except KeyboardInterrupt:
            interrupted = True
        finally:
            interrupted = interrupted or stop.received is not None
            if interrupted:
                progress.close()
                print("\ninterrupted: saving a checkpoint and closing the run", file=stream)
            checkpoint()

    window = max(1, len(meta_losses) // 10)
    start_loss = float(np.mean(meta_losses[:window])) if meta_losses else float("nan")
    end_loss = float(np.mean(meta_losses[-window:])) if meta_losses else float("nan")
    evaluation = {}
    if not interrupted:
        evaluation = evaluate_thetas(
            config, {"trained": learner.theta(), "untrained": initial_theta(config)}
        )
    return RunResult(run_dir, learner.version, start_loss, end_loss, evaluation, interrupted)
