"""The meta-training loop: gather estimates, update theta with them, log, checkpoint.

This is the top of the run: it owns the population (and, for the Ray engine,
the Ray runtime it needs), the learner, the TensorBoard summaries and the
checkpoints, and it closes them in an order that keeps the run directory
consistent whatever fails: the final checkpoint is written first, then the
event files are closed, then the population and finally Ray are shut down.
A run that diverges writes no final checkpoint: its newest checkpoint stays
the last good one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from popmeta.actors.worker import exported_state_template
from popmeta.config import Config, ConfigError, config_to_dict, module_dirs
from popmeta.evaluate import (
    BaselineCache,
    PeriodicEvaluator,
    SettingReport,
    evaluate,
    learned_optimizer_run,
    settings_of,
)
from popmeta.experiment import Experiment, build_experiment
from popmeta.footprint import check_memory
from popmeta.learner.checkpoints import checkpoint_path, list_checkpoints
from popmeta.learner.learner import Learner, Update
from popmeta.population.base import Gathered, Population
from popmeta.population.call_size import size_calls
from popmeta.population.engines import (
    PopulationFactory,
    describe_placement,
    open_population,
    prepare_driver,
)
from popmeta.population.fused import FusedRounds
from popmeta.population.local import LocalPopulation
from popmeta.progress import Progress
from popmeta.run_checkpoints import RunCheckpoints
from popmeta.run_dir import RunDirectory, RunWriteError
from popmeta.run_identity import check_identity, record_config, with_recorded_call_size
from popmeta.run_signals import RunInterrupted, StopSignals
from popmeta.summaries import RoundStats, Summaries, scalar_leaves

__all__ = [
    "DivergedError",
    "RunInterrupted",
    "RunResult",
    "RunWriteError",
    "train",
]

log = logging.getLogger("popmeta")

#: Consecutive rounds with no usable estimate after which the run stops.
MAX_FAILED_ROUNDS = 20


class DivergedError(RuntimeError):
    """No finite estimate for ``MAX_FAILED_ROUNDS`` rounds in a row; theta was left unchanged."""


def _diverged(failures: int, step: int, run: RunDirectory) -> str:
    checkpoints = list_checkpoints(run.checkpoints)
    listing = ", ".join(path.name for path in checkpoints) or "none yet"
    how = (
        " To go on from the newest, which is intact and finite, with a change (e.g. a "
        "smaller outer_optimizer.learning_rate): popmeta train CONFIG --from-checkpoint "
        f"{run.location_of(checkpoints[-1])} --set ...; or start afresh with --set name=NEW."
        if checkpoints
        else " Start afresh with --set name=NEW and, e.g., a smaller outer_optimizer.learning_rate."
    )
    return (
        f"{failures} rounds in a row without a finite estimate at step {step}: every estimate "
        f"was non-finite (counted as rejected_nonfinite in TensorBoard) and theta was left "
        f"unchanged. No checkpoint was written for it: the run's checkpoints ({listing}) are "
        f"those written before.{how}"
    )


class RunResult(NamedTuple):
    """What a call of :func:`train` did.

    Attributes:
      run_dir: the run directory (its storage URI for a remote run).
      final_step: the learner step the run ended at.
      meta_loss_start: mean meta-loss over the first tenth of this call's updates.
      meta_loss_end: mean meta-loss over the last tenth.
      evaluation: the trained learned optimizer, its untrained self and the
        tuned baselines at the trained horizon, with paired intervals (empty
        when interrupted or already finished; ``popmeta eval`` runs every
        setting).
      interrupted: Ctrl-C, SIGTERM or SIGHUP stopped the run (a checkpoint was written).
      already_finished: the run had reached ``train.num_steps`` before this
        call, which then started nothing.
      theta: the learned optimizer's theta at ``final_step``, as numpy arrays
        (``lopt.opt_fn(theta)`` is the trained optimizer).
      checkpoint: the run's newest checkpoint (its storage URI for a remote
        run), or None if it has none.
    """

    run_dir: Path | str
    final_step: int
    meta_loss_start: float
    meta_loss_end: float
    evaluation: list[SettingReport]
    interrupted: bool
    already_finished: bool = False
    theta: Any = None
    checkpoint: Path | str | None = None


def train(
    config: Config,
    population_factory: PopulationFactory | None = None,
    stream=None,
    from_checkpoint: str | Path | None = None,
) -> RunResult:
    """Meta-trains theta for ``config.train.num_steps`` outer steps, resuming if possible.

    Writes ``config.yaml``, TensorBoard events and checkpoints under
    ``run_dir/name``. Ctrl-C stops after the current step, saves a checkpoint
    and closes the event files (so do SIGTERM, e.g. from a scheduler that
    preempts the job, and SIGHUP, from a terminal that closed): the run
    directory stays consistent. Checkpoints hold the learner and the workers'
    states, so a sync run resumed from one continues bit for bit (see
    :mod:`popmeta.run_checkpoints`).

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
      ConfigError: a data file the config names is missing or malformed, the
        workers cannot fit in memory, or JAX already started in this process
        with other CPU devices than the local engine's ``cpu_devices``.
      RunDirectoryError: the run directory holds another experiment, is in use
        by a live run, cannot be written, its checkpoint does not fit, or
        every checkpoint in it is damaged.
      RunWriteError: a file the run must keep could not be written.
      DivergedError: no finite estimate for ``MAX_FAILED_ROUNDS`` rounds.
      RunInterrupted: a signal stopped the run while it was starting or closing.
      ActorStartError, PopulationLostError, PlacementError: the Ray actors
        could not be built or kept up (:mod:`popmeta.population.supervisor`).
    """
    stream = stream or sys.stdout
    prepare_driver(config.population)
    run = RunDirectory(config.run_dir, config.name)
    with StopSignals() as stop:
        try:
            return _start(config, run, population_factory, stream, from_checkpoint, stop)
        except RunInterrupted:
            raise
        except KeyboardInterrupt:
            raise RunInterrupted(stop.interrupted_message(run)) from None


def _start(
    config: Config,
    run: RunDirectory,
    population_factory: PopulationFactory | None,
    stream,
    from_checkpoint: str | Path | None,
    stop: StopSignals,
) -> RunResult:
    run.check_writable()
    config = with_recorded_call_size(run, config)
    experiment = build_experiment(config)
    check_memory(experiment.estimator, experiment.worker.theta, config.population)
    with run.claim():
        if from_checkpoint is None:
            check_identity(run, config)
        else:
            from_checkpoint = run.fetch_checkpoint(from_checkpoint)
        learner = Learner.of(experiment.learner)
        checkpoints = RunCheckpoints(
            run,
            functools.partial(exported_state_template, experiment.worker, experiment.estimator),
            keep=config.train.keep_checkpoints,
            config=config_to_dict(config),
            module_dirs=module_dirs(config),
            learned_optimizer=config.learned_optimizer.kind,
            stream=stream,
        )
        # Restored (so read and checked) before the take-over moves anything:
        # a checkpoint that does not fit leaves the run directory as it was.
        worker_states = checkpoints.restore(learner, from_checkpoint)
        if from_checkpoint is not None:
            run.take_over_from(from_checkpoint)
        if learner.version >= config.train.num_steps:
            print(
                f"{run.location} already finished: step {learner.version} of "
                f"train.num_steps={config.train.num_steps}; raise train.num_steps to train "
                "further, or start a new run with --set name=NEW",
                file=stream,
            )
            return RunResult(
                run.location,
                learner.version,
                math.nan,
                math.nan,
                [],
                interrupted=False,
                already_finished=True,
                theta=learner.theta(),
                checkpoint=_newest_checkpoint(run),
            )
        loop = _RunLoop(config, experiment, run, learner, checkpoints, stream, stop)
        return loop.train(population_factory, worker_states)


def _newest_checkpoint(run: RunDirectory) -> Path | str | None:
    checkpoints = list_checkpoints(run.checkpoints)
    return run.location_of(checkpoints[-1]) if checkpoints else None


def _load_worker_states(population: Population, states: dict[int, Any], stream) -> None:
    """Hands the saved worker states to the population and says which ranks continue."""
    outcome = population.load_worker_states(states)
    lines = [f"worker states restored: rank(s) {list(outcome.restored)}"]
    lines += [f"  rank {rank} starts afresh: {why}" for rank, why in outcome.fresh.items()]
    if outcome.unused:
        lines.append(f"  saved rank(s) {list(outcome.unused)} have no worker in this run")
    print("\n".join(lines), file=stream)


class _RunLoop:
    """One start's training: population, summaries and progress around the learner's steps."""

    def __init__(
        self,
        config: Config,
        experiment: Experiment,
        run: RunDirectory,
        learner: Learner,
        checkpoints: RunCheckpoints,
        stream,
        stop: StopSignals,
    ):
        self.config, self.experiment, self.run, self.learner = config, experiment, run, learner
        self.checkpoints, self.stream, self.stop = checkpoints, stream, stop
        # Where the run is meta-tested (periodically and at the end): built once.
        self.settings = settings_of(config)
        self.meta_losses: list[float] = []
        self._failures = 0  # rounds in a row without a step

    def train(
        self, population_factory: PopulationFactory | None, worker_states: dict[int, Any]
    ) -> RunResult:
        """Trains to ``train.num_steps`` (or a stop), then evaluates unless interrupted."""
        config, run, stream = self.config, self.run, self.stream
        # Closed last-in first-out: the progress bar, the event files, then the
        # population and its runtime. The final checkpoint comes before all of them.
        with contextlib.ExitStack() as closing:
            population = closing.enter_context(
                open_population(
                    config.population,
                    self.experiment.worker,
                    population_factory,
                    config.found_modules(),
                )
            )
            print(describe_placement(config.population, population.describe_actors()), file=stream)
            if config.estimator.truncations_per_call == "auto":
                config = self._size_calls(population)
            if worker_states:
                _load_worker_states(population, worker_states, stream)
            fused = self._fused_rounds(population)
            # The start ends where the directory becomes the run's: a signal
            # from here on stops the run with a checkpoint, never half recorded.
            self.stop.begin_training()
            try:
                record_config(run, config)
            except OSError as err:
                raise run.write_failure(run.config_file, err, self.learner.version) from err
            summaries = Summaries(run.path)
            closing.callback(summaries.close)
            evaluator = (
                PeriodicEvaluator(learned_optimizer_run(config, self.settings[0]))
                if config.eval.every
                else None
            )
            if evaluator is not None:
                closing.callback(evaluator.close, summaries)
            progress = Progress(
                config.train.num_steps, self.learner.version, config.train.log_every
            )
            closing.callback(progress.close)
            interrupted = self._loop(population, fused, summaries, evaluator, progress)
        losses = self.meta_losses
        window = max(1, len(losses) // 10)
        start_loss = float(np.mean(losses[:window])) if losses else float("nan")
        end_loss = float(np.mean(losses[-window:])) if losses else float("nan")
        evaluation = []
        if not interrupted and config.eval.after_training:
            # Its progress goes where the training progress went (stderr), not into the results.
            theta = self.learner.theta()
            evaluation = evaluate(config, theta, self.settings[:1], sys.stderr, BaselineCache())
        return RunResult(
            run.location,
            self.learner.version,
            start_loss,
            end_loss,
            evaluation,
            interrupted,
            theta=self.learner.theta(),
            checkpoint=_newest_checkpoint(run),
        )

    def _size_calls(self, population: Population) -> Config:
        """Resolves ``truncations_per_call: auto`` by measurement; the run records the number.

        Fused rounds take one truncation per estimate unmeasured: a fused call
        pays the host's per-call cost once for all its rounds, which is what
        the measurement would find.
        """
        if self.config.population.updates_per_call > 1:
            size = 1
            print(
                "estimator.truncations_per_call: auto -> 1 (fused rounds pay the host's cost "
                "of a call once per population.updates_per_call rounds)",
                file=self.stream,
            )
        else:
            measured = size_calls(population, self.learner.theta())
            size = measured.truncations_per_call
            print(measured.describe(), file=self.stream)
        population.use_truncations_per_call(size)
        self.config = self.config.with_truncations_per_call(size)
        self.checkpoints.config = config_to_dict(self.config)
        return self.config

    def _fused_rounds(self, population: Population) -> FusedRounds | None:
        """The local engine's fused rounds when ``population.updates_per_call`` asks for them.

        Raises:
          ConfigError: the population is not the local engine's, or a worker
            cannot run fused (its task pulls host batches).
        """
        max_rounds = self.config.population.updates_per_call
        if max_rounds == 1:
            return None
        if not isinstance(population, LocalPopulation):
            raise ConfigError(
                f"population.updates_per_call ({max_rounds}) fuses the local engine's rounds, "
                f"and this run's population is a {type(population).__name__}"
            )
        try:
            fused = population.fused_rounds(self.learner, max_rounds)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        field, shortest = min(self._periods().items(), key=lambda item: item[1])
        if shortest < max_rounds:
            print(
                f"population.updates_per_call: {max_rounds}, but a call ends wherever {field} "
                f"({shortest}) is due, so calls run at most {shortest} rounds; raise {field} "
                "for longer ones",
                file=self.stream,
            )
        return fused

    def _loop(
        self,
        population: Population,
        fused: FusedRounds | None,
        summaries: Summaries,
        evaluator: PeriodicEvaluator | None,
        progress: Progress,
    ) -> bool:
        """The loop, and the checkpoint it ends with; returns whether a signal stopped it."""
        learner, stop = self.learner, self.stop
        stats = RoundStats(
            population.steps_per_estimate,
            self.config.estimator.truncations_per_call,
            self.config.task.kind,
            actors=self.config.population.engine == "ray",
        )
        interrupted = False
        failure: BaseException | None = None
        try:
            for gathered, update, update_seconds, step in self._rounds(population, fused):
                stats.add_round(gathered, update.aggregate)
                if update.norms is None:
                    self._failed_round(step, update, stats, summaries, population)
                    continue
                self._failures = 0
                stats.add_update(update_seconds, update.norms)
                self.meta_losses.append(update.aggregate.mean_loss)
                self._after_step(
                    step,
                    population,
                    summaries,
                    evaluator,
                    stats,
                    progress,
                    update.aggregate.mean_loss,
                )
        except KeyboardInterrupt:
            interrupted = True
        except BaseException as err:
            failure = err
            raise
        finally:
            interrupted = interrupted or stop.received is not None
            stop.phase = "saving"
            # A checkpoint that just failed would fail again, and a diverged
            # run's state is not worth one: its newest checkpoint stays.
            if not isinstance(failure, RunWriteError | DivergedError):
                self._final_checkpoint(population, failure)
            stop.phase = "closing"
            if interrupted:
                progress.close()
                saved = checkpoint_path(self.run.checkpoints, learner.version)
                print(
                    f"\ninterrupted ({stop.received or 'SIGINT'}) at step {learner.version}: "
                    f"{self.run.location_of(saved)} is saved; closing the run",
                    file=self.stream,
                )
        return interrupted

    def _rounds(
        self, population: Population, fused: FusedRounds | None
    ) -> Iterator[tuple[Gathered, Update, float, int]]:
        """Each round until the last step or a stop: its estimates, the update, its time, the step after it.

        With ``fused`` rounds, those of one fused call at a time
        (:mod:`popmeta.population.fused`), which ends where a summary, a
        checkpoint or an evaluation is due; its update times read 0, as the
        update runs inside the call and is timed with the estimates.
        """
        learner, num_steps, stop = self.learner, self.config.train.num_steps, self.stop
        if fused is None:
            while learner.version < num_steps and stop.received is None:
                gathered = population.gather(learner.theta(), learner.version)
                start = time.perf_counter()
                update = learner.update(gathered.estimates)
                yield gathered, update, time.perf_counter() - start, learner.version
            return
        while learner.version < num_steps and stop.received is None:
            call = fused.run(self._rounds_until_due(learner.version, fused.max_rounds))
            for gathered, update in call.rounds():
                step = gathered.estimates[0].version + (update.norms is not None)
                yield gathered, update, 0.0, step

    def _periods(self) -> dict[str, int]:
        """Where a fused call must end, by the field that sets each period (those that are set)."""
        tcfg = self.config.train
        periods = {
            "train.summary_every": tcfg.summary_every,
            "train.checkpoint_every": tcfg.checkpoint_every,
            "eval.every": self.config.eval.every,
        }
        return {name: period for name, period in periods.items() if period}

    def _rounds_until_due(self, step: int, max_rounds: int) -> int:
        """Rounds from ``step`` to the next summary, checkpoint, evaluation or the end, at most ``max_rounds``."""
        due = [period - step % period for period in self._periods().values()]
        return min(max_rounds, self.config.train.num_steps - step, *due)

    def _failed_round(
        self,
        step: int,
        update: Update,
        stats: RoundStats,
        summaries: Summaries,
        population: Population,
    ) -> None:
        """A round without a step: warned of; the run stops after ``MAX_FAILED_ROUNDS`` in a row."""
        self._failures += 1
        log.warning(
            "step %d: no usable estimate (%d non-finite); theta unchanged",
            step,
            update.aggregate.num_rejected_nonfinite,
        )
        if self._failures >= MAX_FAILED_ROUNDS:
            stats.write(summaries, step, population.num_live)
            raise DivergedError(_diverged(self._failures, step, self.run))

    def _after_step(
        self,
        step: int,
        population: Population,
        summaries: Summaries,
        evaluator: PeriodicEvaluator | None,
        stats: RoundStats,
        progress: Progress,
        meta_loss: float,
    ) -> None:
        tcfg = self.config.train
        if step % tcfg.summary_every == 0 or step == tcfg.num_steps:
            stats.write(summaries, step, population.num_live)
            if theta_values := scalar_leaves(self.learner.theta(), "theta"):
                summaries.scalars(step, theta_values)
            self.run.sync_if_due()
        if self._checkpoint_due(step):
            self._checkpoint(population)
        if evaluator is not None:
            evaluator.write_finished(summaries)
            if step % self.config.eval.every == 0:
                evaluator.submit(step, self.learner.theta())
        fields = {
            "meta_loss": f"{meta_loss:.4f}",
            "est/s": f"{stats.last_estimates_per_s:.1f}",
            "trunc/call": str(self.config.estimator.truncations_per_call),
            "actors": str(population.num_live),
        }
        progress.update(step, tcfg.num_steps, fields)

    def _checkpoint_due(self, step: int) -> bool:
        """The checkpoint rule between steps; a stop or the end always writes one (the loop's)."""
        return step % self.config.train.checkpoint_every == 0

    def _checkpoint(self, population: Population) -> None:
        """The checkpoint of this step (see :meth:`RunCheckpoints.save`); a failed write stops the run."""
        try:
            self.checkpoints.save(self.learner, population.export_worker_states)
        except OSError as err:
            path = checkpoint_path(self.run.checkpoints, self.learner.version)
            raise self.run.write_failure(path, err, self.learner.version) from err

    def _final_checkpoint(self, population: Population, failure: BaseException | None) -> None:
        try:
            self._checkpoint(population)
        except RunWriteError as err:
            if failure is None:
                raise
            # The run's own error propagates; this one is only reported.
            log.error("the final checkpoint was not written: %s", err)
