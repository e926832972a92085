"""The meta-training loop: gather estimates, update theta with them, log, checkpoint.

This is the top of the run: it owns the population (and, for the Ray engine,
the Ray runtime it needs), the learner, the TensorBoard summaries and the
checkpoints, and it closes them in an order that keeps the run directory
consistent whatever fails: the final checkpoint is written first, then the
event files are closed, then the population and finally Ray are shut down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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

from popmeta.actors.worker import exported_state_template
from popmeta.config import Config, ConfigError, config_to_dict
from popmeta.evaluate import PeriodicEvaluator, SettingReport, evaluate, settings_of
from popmeta.experiment import build_task_family
from popmeta.learner.checkpoints import (
    Checkpoint,
    CheckpointCorruptedError,
    checkpoint_path,
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

__all__ = ["DivergedError", "RunResult", "RunWriteError", "open_population", "train"]

log = logging.getLogger("popmeta")

#: Consecutive rounds with no usable estimate after which the run stops.
MAX_FAILED_ROUNDS = 20

#: The checkpoint section with the workers' exported states, by rank: optional,
#: so readers that need only the learner (evaluation) leave it out.
WORKERS = "workers"


class DivergedError(RuntimeError):
    """No finite estimate for ``MAX_FAILED_ROUNDS`` rounds in a row; theta was left unchanged."""


class RunWriteError(RuntimeError):
    """A file the run must keep (a checkpoint, its config) could not be written.

    The disk is full, the run directory became read-only, or the disk failed.
    The run stopped after its current step; the checkpoints written before are
    intact (a checkpoint is renamed into place only once complete). The
    message names the file, the OS error, what to do and the checkpoint a
    rerun of the same command resumes from.
    """


def _write_failed(path: Path, err: OSError, step: int, run: RunDirectory) -> str:
    checkpoints = list_checkpoints(run.checkpoints)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"Free space on the disk that holds {run.path}"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"Make {run.path} writable again (it is read-only or its permissions changed)"
    else:
        fix = f"Check the disk that holds {run.path}"
    resume = (
        f"then rerun the same command: it resumes from {run.location_of(checkpoints[-1])}, the "
        "newest checkpoint, "
        "which is intact."
        if checkpoints
        else "then rerun the same command; no checkpoint was written yet, so it starts afresh."
    )
    return (
        f"cannot write {path}: {err.strerror or err} (errno {err.errno}). The run stopped "
        f"at step {step}. {fix}, {resume}"
    )


def _diverged(failures: int, step: int, run: RunDirectory) -> str:
    checkpoints = list_checkpoints(run.checkpoints)
    listing = ", ".join(path.name for path in checkpoints) or "none yet"
    # The newest holds the theta whose estimates are all non-finite: suggest the one before.
    start = checkpoints[-2] if len(checkpoints) > 1 else (checkpoints or [None])[-1]
    how = (
        f" To go on from an earlier one with a change (e.g. a smaller "
        f"outer_optimizer.learning_rate): popmeta train CONFIG --from-checkpoint {run.location_of(start)} "
        "--set ...; or start afresh with --set name=NEW."
        if start is not None
        else " Start afresh with --set name=NEW and, e.g., a smaller outer_optimizer.learning_rate."
    )
    return (
        f"{failures} rounds in a row without a finite estimate at step {step}: every estimate "
        f"was non-finite (counted as rejected_nonfinite in TensorBoard) and theta was left "
        f"unchanged. Checkpoints of {run.location}: {listing}.{how}"
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
      run_dir: the run directory (its storage URI for a remote run).
      final_step: the learner step the run ended at.
      meta_loss_start: mean meta-loss over the first tenth of this call's updates.
      meta_loss_end: mean meta-loss over the last tenth.
      evaluation: the trained learned optimizer, its untrained self and the
        tuned baselines at the trained horizon, with paired intervals (empty
        when interrupted or already finished; ``popmeta eval`` runs every
        setting).
      interrupted: Ctrl-C or SIGTERM stopped the run (a checkpoint was written).
      already_finished: the run had reached ``train.num_steps`` before this
        call, which then started nothing.
    """

    run_dir: Path | str
    final_step: int
    meta_loss_start: float
    meta_loss_end: float
    evaluation: list[SettingReport]
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
    preempts the job): the run directory stays consistent. Checkpoints hold the
    learner and the workers' states, so a sync run resumed from one continues
    bit for bit (see :func:`_checkpoint_contents` and :func:`_saved_worker_states`).

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
            from_checkpoint = run.fetch_checkpoint(from_checkpoint)
        learner = Learner(config)
        # Restored (so read and checked) before the take-over moves anything:
        # a checkpoint that does not fit leaves the run directory as it was.
        worker_states = _restore(learner, run, from_checkpoint, stream)
        if from_checkpoint is not None:
            run.take_over_from(from_checkpoint)
        if learner.version >= config.train.num_steps:
            print(
                f"{run.location} already finished: step {learner.version} of "
                f"train.num_steps={config.train.num_steps}; raise train.num_steps to train "
                "further, or start a new run with --set name=NEW",
                file=stream,
            )
            return RunResult(run.location, learner.version, math.nan, math.nan, [], False, True)
        return _train(config, run, learner, population_factory, stream, worker_states)


def _check_task_data(config: Config) -> None:
    """Builds every task family the config names once in the driver (the training one
    and the evaluation's out-of-distribution ones): data files fail here, before any
    actor starts."""
    tasks = {"task": config.task}
    for name, task in config.eval.out_of_distribution.items():
        tasks[f"eval.out_of_distribution.{name}"] = task
    for prefix, task in tasks.items():
        for field, family in task.named_families():
            try:
                build_task_family(dataclasses.replace(task, family=family, families={}))
            except (OSError, ValueError) as err:
                # named_families() names fields of the training task section.
                field = "task.npz_path" if task.npz_path is not None else field
                where = prefix + field.removeprefix("task")
                raise ConfigError(f"{where}: {err}") from None


def _restore(
    learner: Learner, run: RunDirectory, from_checkpoint: str | Path | None, stream
) -> dict[int, Any]:
    """Restores the learner from ``from_checkpoint``, else from the run's newest checkpoint.

    Returns:
      The worker states saved with it, by rank (see :func:`_saved_worker_states`).
    """
    target = learner.checkpoint_tree()
    try:
        if from_checkpoint is not None:
            restored = load_checkpoint(from_checkpoint, target)
        else:
            restored = restore_latest(run.checkpoints, target)
    except (OSError, CheckpointCorruptedError) as err:
        if from_checkpoint is None:  # restore_latest skips damaged files itself
            raise
        raise RunDirectoryError(f"--from-checkpoint {from_checkpoint}: {err}") from None
    except ValueError as err:
        raise RunDirectoryError(
            f"{err}. The checkpoint does not fit learned_optimizer.kind="
            f"{run.config.learned_optimizer.kind!r} as configured; start a new run with "
            "--set name=NEW"
        ) from None
    if restored is None:
        return {}
    learner.restore(restored.tree)
    print(f"resumed from {restored.path} at step {learner.version}", file=stream)
    return _saved_worker_states(run.config, learner, restored, stream)


def _saved_worker_states(
    config: Config, learner: Learner, restored: Checkpoint, stream
) -> dict[int, Any]:
    """The worker states saved in the ``restored`` checkpoint, by rank.

    Empty when it has none (a checkpoint written mid-round, or before worker
    states were saved), or when they do not fit ``config`` (a take-over that
    changed the estimator or the tasks): the workers then start afresh.
    """
    ranks = restored.metadata.get("worker_ranks", [])
    if not ranks:
        return {}
    template = exported_state_template(config)
    target = {**learner.checkpoint_tree(), WORKERS: {str(rank): template for rank in ranks}}
    try:
        tree = load_checkpoint(restored.path, target).tree
    except ValueError as err:
        print(
            f"the worker states in {restored.path} do not fit this config ({err}); "
            "every worker starts afresh",
            file=stream,
        )
        return {}
    return {int(rank): state for rank, state in tree[WORKERS].items()}


def _load_worker_states(population: Population, states: dict[int, Any], stream) -> None:
    """Hands the saved worker states to the population and says which ranks continue."""
    outcome = population.load_worker_states(states)
    lines = [f"worker states restored: rank(s) {list(outcome.restored)}"]
    lines += [f"  rank {rank} starts afresh: {why}" for rank, why in outcome.fresh.items()]
    if outcome.unused:
        lines.append(f"  saved rank(s) {list(outcome.unused)} have no worker in this run")
    print("\n".join(lines), file=stream)


def _checkpoint_contents(
    learner: Learner, population: Population, config: Config
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree and metadata of a checkpoint now: the learner, and the workers' states.

    The worker states are left out where the population has none to give (a
    round interrupted half-way) or cannot give them: the learner's checkpoint
    is written whatever happened to the workers.
    """
    tree = learner.checkpoint_tree()
    try:
        states = population.export_worker_states()
    except Exception as err:  # whatever the workers did, the learner's checkpoint is written
        log.warning("the worker states are not saved in this checkpoint: %r", err)
        states = {}
    if states:
        tree[WORKERS] = {str(rank): state for rank, state in states.items()}
    metadata = {"config": config_to_dict(config), "worker_ranks": sorted(states)}
    return tree, metadata


def _train(
    config: Config,
    run: RunDirectory,
    learner: Learner,
    population_factory: PopulationFactory | None,
    stream,
    worker_states: dict[int, Any],
) -> RunResult:
    run_dir, ckpt_dir = run.path, run.checkpoints
    tcfg = config.train
    meta_losses: list[float] = []
    interrupted = False
    failure: BaseException | None = None
    failures = 0
    saved_step: int | None = None

    def checkpoint():
        nonlocal saved_step
        if saved_step == learner.version:
            # This run saved this step already (at its boundary, with the
            # worker states): the final save after a boundary would repeat it.
            return
        tree, metadata = _checkpoint_contents(learner, population, config)
        if WORKERS not in tree and checkpoint_path(ckpt_dir, learner.version).exists():
            # Interrupted half-way through a round: this step's checkpoint,
            # written at its boundary with the worker states, stays.
            return
        try:
            save_checkpoint(
                ckpt_dir,
                learner.version,
                tree,
                keep=tcfg.keep_checkpoints,
                metadata=metadata,
                optional=(WORKERS,) if WORKERS in tree else (),
            )
        except OSError as err:
            path = checkpoint_path(ckpt_dir, learner.version)
            raise RunWriteError(_write_failed(path, err, learner.version, run)) from err
        saved_step = learner.version
        run.sync()

    # Closed last-in first-out: the progress bar, the event files, then the
    # population and its runtime. The final checkpoint comes before all of them.
    with contextlib.ExitStack() as closing:
        population = closing.enter_context(open_population(config, population_factory))
        print(_placement(population.describe_actors()), file=stream)
        if worker_states:
            _load_worker_states(population, worker_states, stream)
        try:
            run.record_config()
        except OSError as err:
            raise RunWriteError(_write_failed(run.config_file, err, learner.version, run)) from err
        summaries = Summaries(run_dir)
        closing.callback(summaries.close)
        evaluator = PeriodicEvaluator(config) if config.eval.every else None
        if evaluator is not None:
            closing.callback(evaluator.close, summaries)
        stats = RoundStats(population.steps_per_estimate, config.task.family)
        progress = _Progress(tcfg.num_steps, learner.version, tcfg.log_every)
        closing.callback(progress.close)
        stop = closing.enter_context(_StopSignals())
        try:
            while learner.version < tcfg.num_steps and stop.received is None:
                gathered = population.gather(learner.theta(), learner.version)
                update_start = time.perf_counter()
                update = learner.update(gathered.estimates)
                update_seconds = time.perf_counter() - update_start
                agg = update.aggregate
                stats.add_round(gathered, agg)
                if update.norms is None:
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
                stats.add_update(update_seconds, update.norms)
                step = learner.version
                meta_losses.append(agg.mean_loss)
                if step % tcfg.summary_every == 0 or step == tcfg.num_steps:
                    stats.write(summaries, step, population.num_live)
                    run.sync_if_due()
                if step % tcfg.checkpoint_every == 0:
                    checkpoint()
                if evaluator is not None:
                    evaluator.write_finished(summaries)
                    if step % config.eval.every == 0:
                        evaluator.submit(step, learner.theta())
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
        except BaseException as err:
            failure = err
            raise
        finally:
            interrupted = interrupted or stop.received is not None
            if interrupted:
                progress.close()
                print("\ninterrupted: saving a checkpoint and closing the run", file=stream)
            # A checkpoint that just failed would fail again: one error, not two.
            if not isinstance(failure, RunWriteError):
                try:
                    checkpoint()
                except RunWriteError as err:
                    if failure is None:
                        raise
                    # The run's own error propagates; this one is only reported.
                    log.error("the final checkpoint was not written: %s", err)

    window = max(1, len(meta_losses) // 10)
    start_loss = float(np.mean(meta_losses[:window])) if meta_losses else float("nan")
    end_loss = float(np.mean(meta_losses[-window:])) if meta_losses else float("nan")
    evaluation = []
    if not interrupted and config.eval.after_training:
        # Its progress goes where the training progress went (stderr), not into the results.
        evaluation = evaluate(config, learner.theta(), settings_of(config)[:1], stream=sys.stderr)
    return RunResult(run.location, learner.version, start_loss, end_loss, evaluation, interrupted)
