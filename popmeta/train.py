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
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from popmeta.config import Config, config_to_dict, config_to_yaml
from popmeta.estimate import aggregate
from popmeta.evaluate import EvalResult, evaluate_thetas
from popmeta.experiment import initial_theta
from popmeta.learner.checkpoints import restore_latest, save_checkpoint
from popmeta.learner.learner import Learner
from popmeta.population.base import Population
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation
from popmeta.population.ray_runtime import start_ray_for
from popmeta.summaries import RoundStats, Summaries

__all__ = ["RunResult", "open_population", "train"]

log = logging.getLogger("popmeta")

#: Consecutive rounds with no usable estimate after which the run stops.
MAX_FAILED_ROUNDS = 20


class RunResult(NamedTuple):
    run_dir: Path
    final_step: int
    meta_loss_start: float
    meta_loss_end: float
    evaluation: dict[str, EvalResult]
    interrupted: bool


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
) -> RunResult:
    """Meta-trains theta for ``config.train.num_steps`` outer steps, resuming if possible.

    Writes ``config.yaml``, TensorBoard events and checkpoints under
    ``run_dir/name``. Ctrl-C stops after the current step, saves a checkpoint
    and closes the event files: the run directory stays consistent.

    Args:
      config: the run's config.
      population_factory: builds the population; by default the one
        ``population.engine`` names, with the runtime it needs (see
        :func:`open_population`).
      stream: where progress lines go (default stdout).
    """
    stream = stream or sys.stdout
    run_dir = Path(config.run_dir) / config.name
    ckpt_dir = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(config))

    learner = Learner(config)
    restored = restore_latest(ckpt_dir, learner.checkpoint_tree())
    if restored is not None:
        learner.restore(restored.tree)
        print(f"resumed from {restored.path} at step {learner.version}", file=stream)

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
        summaries = Summaries(run_dir)
        closing.callback(summaries.close)
        stats = RoundStats(population.steps_per_estimate, config.task.family)
        progress = _Progress(tcfg.num_steps, learner.version, tcfg.log_every)
        closing.callback(progress.close)
        try:
            while learner.version < tcfg.num_steps:
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
                        raise RuntimeError(
                            f"{failures} rounds in a row without a finite estimate at step "
                            f"{learner.version}; the last checkpoint is kept in {ckpt_dir}"
                        )
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
            progress.close()
            print("\ninterrupted: saving a checkpoint and closing the run", file=stream)
        finally:
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
