"""Where a learned optimizer is meta-tested, and the runs of it and of the tuned baselines there.

Settings: ``trained horizon`` (the training family for the longest trajectory
training used, or ``eval.num_steps``), ``{k}x horizon`` (the same family for
``k`` times as many steps, each of ``eval.long_horizon_factors``), each for
every member of a mixture with ``eval.each_training_family``, one per
entry of ``eval.out_of_distribution`` (other families at the trained horizon)
and, with ``eval.optax_cosine``, the trained horizon with the learned
optimizer run through optax under an external cosine schedule. The
learned optimizer and every baseline run on the same test tasks (same task
samples, initialisations and batches), which no learning rate was chosen on.
Per task: the mean training loss over the curve, the test loss after the last
step and, for tasks with labels, the test accuracy.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
import optax

from popmeta.config import Config, ConfigError, TaskConfig
from popmeta.core.evaluation import TrainingCurves, training_curves
from popmeta.core.learned_optimizers import as_optax
from popmeta.core.optimizers import OptaxOptimizer, Optimizer
from popmeta.evaluate.baselines import BASELINES, BaselineCache, TunedBaseline, tune_baseline
from popmeta.evaluate.statistics import Comparison, TaskScores, compare, scores_of
from popmeta.experiment import (
    EstimatorSections,
    build_learned_optimizer,
    build_task_family,
    build_truncation_schedule,
    initial_theta,
)

__all__ = [
    "BASELINE_THREADS",
    "Setting",
    "SettingReport",
    "UnitProgress",
    "evaluate",
    "evaluate_setting",
    "learned_optimizer_run",
    "settings_of",
    "trained_horizon",
]


#: Baselines tuned at once in a setting.
BASELINE_THREADS = 2


class Setting(NamedTuple):
    """Where an optimizer is tested: a task family and a number of inner steps.

    Attributes:
      through_optax_cosine: the learned optimizers run as a user runs them
        with an external schedule: ``optax.chain(as_optax(...),
        scale_by_schedule(cosine decay to 0 over num_steps))``.
    """

    name: str
    task: TaskConfig
    num_steps: int
    through_optax_cosine: bool = False


class SettingReport(NamedTuple):
    """Everything measured in one setting."""

    setting: Setting
    num_tasks: int
    scores: dict[str, TaskScores]  # "learned", "untrained", then the baselines
    learning_rates: dict[str, float]  # tuned learning rate of each baseline
    comparisons: list[Comparison]

    def comparison(self, baseline: str, metric: str) -> Comparison | None:
        return next(
            (c for c in self.comparisons if c.baseline == baseline and c.metric == metric), None
        )


def trained_horizon(config: Config) -> int:
    """Inner steps of the trained-horizon setting (see :class:`~popmeta.config.EvalConfig`)."""
    if config.eval.num_steps is not None:
        return config.eval.num_steps
    longest = getattr(build_truncation_schedule(config.truncation), "max_length", None)
    if not isinstance(longest, int | np.integer):
        raise ConfigError(
            f"eval.num_steps: truncation.kind={config.truncation.kind!r} has no longest "
            "trajectory (max_length) to meta-test at; set eval.num_steps"
        )
    return int(longest)


def settings_of(config: Config) -> list[Setting]:
    """The settings ``config.eval`` names, the trained horizon first."""
    steps = trained_horizon(config)
    families = [("", config.task)]
    if config.eval.each_training_family and config.task.mixture:
        families = [(f"{label}: ", m.task) for label, m in config.task.mixture.items()]
    settings = []
    for prefix, task in families:
        settings.append(Setting(f"{prefix}trained horizon", task, steps))
        settings += [
            Setting(f"{prefix}{factor}x horizon", task, factor * steps)
            for factor in config.eval.long_horizon_factors
        ]
    for name, task in config.eval.out_of_distribution.items():
        settings.append(Setting(name, task, steps))
    if config.eval.optax_cosine:
        name = "trained horizon, through optax with cosine decay"
        settings.append(Setting(name, config.task, steps, through_optax_cosine=True))
    return settings


class UnitProgress:
    """Progress over units of work: a bar on a terminal, a line per unit otherwise."""

    def __init__(self, total: int, stream: TextIO | None, desc: str = "eval"):
        self.stream = stream
        self.bar = None
        if stream is not None and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=stream, leave=False)
        self.desc, self.total, self.done = desc, total, 0

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        elif self.stream is not None:
            print(f"{self.desc} {self.done}/{self.total}: {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def learned_optimizer_run(config: Config, setting: Setting) -> Callable[[Any], TrainingCurves]:
    """``run(theta)``: the learned optimizer's curves on the setting's test tasks, one compile."""
    family = build_task_family(setting.task)
    lopt = build_learned_optimizer(config.learned_optimizer)
    n, steps = config.eval.num_tasks, setting.num_steps
    key = jax.random.key(config.eval.seed)

    def optimizer(theta: Any) -> Optimizer:
        if not setting.through_optax_cosine:
            return lopt.opt_fn(theta)
        schedule = optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, steps))
        return OptaxOptimizer(optax.chain(as_optax(lopt, theta, num_steps=steps), schedule))

    return jax.jit(lambda theta: training_curves(family, optimizer(theta), key, n, steps))


def evaluate_setting(
    config: Config,
    setting: Setting,
    thetas: dict[str, Any],
    units: UnitProgress | None = None,
    baseline_cache: BaselineCache | None = None,
) -> SettingReport:
    """Runs ``thetas`` (learned optimizers) and the tuned baselines in one setting.

    Args:
      config: the run's config (learned optimizer, ``eval`` section).
      setting: where to run.
      thetas: name -> theta.
      units: progress.
      baseline_cache: where tuned baselines are looked up and kept; None tunes them here.
    """
    family = build_task_family(setting.task)
    n, steps, seed = config.eval.num_tasks, setting.num_steps, config.eval.seed
    run_theta = learned_optimizer_run(config, setting)

    scores: dict[str, TaskScores] = {}
    for name, theta in thetas.items():
        scores[name] = scores_of(run_theta(theta))
        if units:
            units.step(f"{setting.name}: {name}")

    def tuned(name: str) -> TunedBaseline:
        ev = config.eval
        if baseline_cache is None:
            return tune_baseline(
                family, BASELINES[name], n, steps, seed, ev.tuning, ev.tuning_tasks
            )
        return baseline_cache.tuned(
            family, setting.task, name, n, steps, seed, ev.tuning, ev.tuning_tasks
        )

    learning_rates: dict[str, float] = {}
    # Two at a time: a baseline's time is mostly XLA compiling its two programs,
    # which runs on one core; the results do not depend on the order.
    with concurrent.futures.ThreadPoolExecutor(BASELINE_THREADS) as pool:
        for name, baseline in zip(BASELINES, pool.map(tuned, BASELINES), strict=True):
            learning_rates[name] = baseline.learning_rate
            scores[name] = baseline.scores
            if units:
                units.step(f"{setting.name}: {name} (lr {baseline.learning_rate:.2g})")

    comparisons = []
    if "learned" in scores:
        for name in BASELINES:
            comparisons.extend(compare(scores["learned"], scores[name], name))
    return SettingReport(setting, n, scores, learning_rates, comparisons)


def evaluate(
    config: Config,
    theta: Any,
    settings: Sequence[Setting] | None = None,
    stream: TextIO | None = None,
    baseline_cache: BaselineCache | None = None,
) -> list[SettingReport]:
    """The learned optimizer ``theta`` (and its untrained self) against the tuned baselines.

    Args:
      config: the run's config (task, learned optimizer, ``eval`` section).
      theta: the learned optimizer's meta-parameters.
      settings: where to test; default :func:`settings_of` ``(config)``.
      stream: where progress goes (a bar on a terminal, lines otherwise); None: silent.
      baseline_cache: where tuned baselines are looked up and kept; None tunes them here.

    Returns:
      One report per setting.
    """
    settings = settings_of(config) if settings is None else list(settings)
    thetas = {"learned": theta, "untrained": initial_theta(EstimatorSections.of(config))}
    units = UnitProgress(len(settings) * (len(thetas) + len(BASELINES)), stream)
    try:
        return [evaluate_setting(config, s, thetas, units, baseline_cache) for s in settings]
    finally:
        units.close()
