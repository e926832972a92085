"""Meta-testing: a learned optimizer against tuned hand-designed baselines, with intervals.

Settings. A learned optimizer is judged where it was trained and beyond:

* ``trained horizon``: the training task family for the trajectory length
  training used (``eval.num_steps``, by default ``truncation.length``, or
  ``truncation.max_length`` for ``log_uniform``);
* ``{k}x horizon``: the same family for ``k`` times as many steps
  (``eval.long_horizon_factor``), where learned optimizers often diverge;
* one setting per entry of ``eval.out_of_distribution``: other task families
  (other architectures, other data) at the trained horizon.

Baselines. Adam, Adam with cosine decay to zero over the setting's horizon,
SGD with momentum 0.9 and SGD, each at the learning rate, out of 21 points
spaced 4 per decade over [1e-5, 1], with the lowest mean training loss on
*tuning* tasks (drawn from ``eval.seed + 1``), separately for each setting.
The learned optimizer and every baseline are then run on the same *test* tasks
(drawn from ``eval.seed``: same task samples, initialisations and batches),
which no learning rate was chosen on.

Statistics. Per held-out task we record the mean training loss over the whole
curve (speed and final quality together), the test loss after the last step
and, for tasks with labels, the test accuracy after the last step. Each
comparison is paired by task: the mean of ``learned - baseline`` with a 95%
interval ``t(0.975, n-1) * sd / sqrt(n)`` over the ``n`` test tasks. The
verdict is WIN when the whole interval favours the learned optimizer (below
zero for losses, above zero for accuracy), LOSS when it favours the baseline,
and TIE when it contains zero. A task whose run diverged (a non-finite loss)
scores an infinite loss; a comparison with diverged tasks is decided by which
side diverged more often.
"""

from __future__ import annotations

import csv
import math
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
import optax

from popmeta.config import Config, TaskConfig, config_from_dict
from popmeta.core.evaluation import TrainingCurves, training_curves
from popmeta.core.optimizers import SGD, SGDM, Adam, OptaxOptimizer, Optimizer
from popmeta.experiment import build_learned_optimizer, build_task_family, initial_theta
from popmeta.learner.checkpoints import load_checkpoint, read_checkpoint_metadata
from popmeta.learner.learner import Learner
from popmeta.storage import (
    RemoteDir,
    StorageError,
    is_remote,
    join,
    local_file,
    local_output_dir,
    local_path,
    parent,
)
from popmeta.summaries import Summaries

__all__ = [
    "BASELINES",
    "LEARNING_RATES",
    "Comparison",
    "EvalOutput",
    "EvalWriteError",
    "PeriodicEvaluator",
    "Setting",
    "SettingReport",
    "TaskScores",
    "check_output_dir",
    "compare",
    "evaluate",
    "evaluate_checkpoint",
    "format_reports",
    "load_theta",
    "paired_interval",
    "settings_of",
    "trained_horizon",
    "write_reports",
]

#: Hand-designed baselines: ``make(learning_rate, num_steps)``.
BASELINES: dict[str, Callable[[Any, int], Optimizer]] = {
    "adam": lambda lr, num_steps: Adam(lr),
    "adam_cosine": lambda lr, num_steps: OptaxOptimizer(
        optax.adam(optax.cosine_decay_schedule(lr, num_steps))
    ),
    "sgdm": lambda lr, num_steps: SGDM(lr, 0.9),
    "sgd": lambda lr, num_steps: SGD(lr),
}
#: The tuning grid: 4 points per decade over [1e-5, 1].
LEARNING_RATES = np.logspace(-5, 0, 21).astype(np.float32)

#: Metric name -> whether higher is better.
METRICS = {"mean_train_loss": False, "final_test_loss": False, "final_test_accuracy": True}


class Setting(NamedTuple):
    """Where an optimizer is tested: a task family and a number of inner steps."""

    name: str
    task: TaskConfig
    num_steps: int


class TaskScores(NamedTuple):
    """One optimizer's results on the held-out tasks of one setting.

    Attributes:
      mean_train_loss: ``[n]`` per task, the training loss averaged over the curve.
      final_test_loss: ``[n]`` per task, the test loss after the last step.
      final_test_accuracy: ``[n]`` per task, or None for tasks without labels.
      train_curve: ``[n, steps]`` training loss per step.
      test_curve: ``[n, steps]`` test loss after each step.
    """

    mean_train_loss: np.ndarray
    final_test_loss: np.ndarray
    final_test_accuracy: np.ndarray | None
    train_curve: np.ndarray
    test_curve: np.ndarray

    def metric(self, name: str) -> np.ndarray | None:
        return getattr(self, name)


class Comparison(NamedTuple):
    """``learned - baseline`` on one metric, paired by task."""

    baseline: str
    metric: str
    difference: float
    half_width: float
    verdict: str  # WIN, TIE or LOSS, from the learned optimizer's side


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


class EvalOutput(NamedTuple):
    """Where :func:`write_reports` put its files."""

    png: str
    csv: str
    tensorboard: str


# -- statistics -----------------------------------------------------------------------------


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom.

    Cornish-Fisher expansion around the normal quantile (Abramowitz and Stegun
    26.7.5), within 5e-4 from ``df = 5`` on, with the tabulated values below
    that: all the interval needs (numpy has no t distribution).
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    exact_small = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764}
    if df in exact_small:
        return exact_small[df]
    z = 1.959963984540054
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def paired_interval(learned: np.ndarray, baseline: np.ndarray) -> tuple[float, float]:
    """Mean of ``learned - baseline`` over tasks and its 95% half-width.

    Non-finite values make both infinite or NaN; :func:`_verdict` handles them.
    """
    diff = np.asarray(learned, np.float64) - np.asarray(baseline, np.float64)
    n = diff.size
    if n < 2:
        raise ValueError(f"an interval over tasks needs at least 2 tasks, got {n}")
    mean, half_width = _mean_interval(diff)
    return float(mean), float(half_width)


def _verdict(
    learned: np.ndarray,
    baseline: np.ndarray,
    mean: float,
    half_width: float,
    higher_is_better: bool,
) -> str:
    bad_learned = int(np.sum(~np.isfinite(learned)))
    bad_baseline = int(np.sum(~np.isfinite(baseline)))
    if bad_learned or bad_baseline:
        if bad_learned == bad_baseline:
            return "TIE"
        return "LOSS" if bad_learned > bad_baseline else "WIN"
    low, high = mean - half_width, mean + half_width
    if higher_is_better:
        low, high = -high, -low
    if high < 0:
        return "WIN"
    if low > 0:
        return "LOSS"
    return "TIE"


def compare(learned: TaskScores, baseline: TaskScores, name: str) -> list[Comparison]:
    """``learned - baseline`` on every metric both have."""
    comparisons = []
    for metric, higher_is_better in METRICS.items():
        a, b = learned.metric(metric), baseline.metric(metric)
        if a is None or b is None:
            continue
        mean, half_width = paired_interval(a, b)
        verdict = _verdict(a, b, mean, half_width, higher_is_better)
        comparisons.append(Comparison(name, metric, mean, half_width, verdict))
    return comparisons


def _mean_interval(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    n = values.shape[axis]
    with np.errstate(invalid="ignore"):
        mean = values.mean(axis=axis)
        half_width = t_quantile_975(max(n - 1, 1)) * values.std(axis=axis, ddof=1) / math.sqrt(n)
    return mean, half_width


# -- settings and runs ----------------------------------------------------------------------


def trained_horizon(config: Config) -> int:
    """Inner steps of the trained-horizon setting (see :class:`~popmeta.config.EvalConfig`)."""
    if config.eval.num_steps is not None:
        return config.eval.num_steps
    truncation = config.truncation
    return truncation.max_length if truncation.schedule == "log_uniform" else truncation.length


def settings_of(config: Config) -> list[Setting]:
    """The settings ``config.eval`` names, the trained horizon first."""
    steps = trained_horizon(config)
    settings = [Setting("trained horizon", config.task, steps)]
    factor = config.eval.long_horizon_factor
    if factor:
        settings.append(Setting(f"{factor}x horizon", config.task, factor * steps))
    for name, task in config.eval.out_of_distribution.items():
        settings.append(Setting(name, task, steps))
    return settings


def _scores(curves: TrainingCurves) -> TaskScores:
    train = np.asarray(curves.train_loss, np.float64)
    test = np.asarray(curves.eval_loss, np.float64)
    # A diverged task scores an infinite loss, never a NaN that compares false.
    mean_train = np.where(np.all(np.isfinite(train), axis=-1), train.mean(axis=-1), np.inf)
    final_test = np.where(np.isfinite(test[..., -1]), test[..., -1], np.inf)
    accuracy = None
    if curves.final_accuracy is not None:
        accuracy = np.nan_to_num(np.asarray(curves.final_accuracy, np.float64), nan=0.0)
    return TaskScores(mean_train, final_test, accuracy, train, test)


class _Units:
    """Progress over units of work: a bar on a terminal, a line per unit otherwise."""

    def __init__(self, total: int, stream: TextIO | None):
        self.stream = stream
        self.bar = None
        if stream is not None and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="eval", file=stream, leave=False)
        self.total, self.done = total, 0

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        elif self.stream is not None:
            print(f"eval {self.done}/{self.total}: {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _units_per_setting(num_thetas: int) -> int:
    return num_thetas + len(BASELINES)


def _learned_optimizer_run(config: Config, setting: Setting) -> Callable[[Any], TrainingCurves]:
    """``run(theta)``: the learned optimizer's curves on the setting's test tasks, one compile."""
    family = build_task_family(setting.task)
    lopt = build_learned_optimizer(config.learned_optimizer)
    n, steps = config.eval.num_tasks, setting.num_steps
    key = jax.random.key(config.eval.seed)
    return jax.jit(lambda theta: training_curves(family, lopt.opt_fn(theta), key, n, steps))


def evaluate_setting(
    config: Config,
    setting: Setting,
    thetas: dict[str, Any],
    units: _Units | None = None,
) -> SettingReport:
    """Runs ``thetas`` (learned optimizers) and the tuned baselines in one setting."""
    family = build_task_family(setting.task)
    n, steps = config.eval.num_tasks, setting.num_steps
    test_key = jax.random.key(config.eval.seed)
    tune_key = jax.random.key(config.eval.seed + 1)
    run_theta = _learned_optimizer_run(config, setting)

    scores: dict[str, TaskScores] = {}
    for name, theta in thetas.items():
        scores[name] = _scores(run_theta(theta))
        if units:
            units.step(f"{setting.name}: {name}")

    learning_rates: dict[str, float] = {}
    for name, make in BASELINES.items():

        def run(lr, key, make=make):
            return training_curves(family, make(lr, steps), key, n, steps)

        tuning = _scores(jax.jit(jax.vmap(run, in_axes=(0, None)))(LEARNING_RATES, tune_key))
        best = int(np.argmin(tuning.mean_train_loss.mean(axis=-1)))
        learning_rates[name] = float(LEARNING_RATES[best])
        scores[name] = _scores(jax.jit(run)(LEARNING_RATES[best], test_key))
        if units:
            units.step(f"{setting.name}: {name} (lr {learning_rates[name]:.2g})")

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
) -> list[SettingReport]:
    """The learned optimizer ``theta`` (and its untrained self) against the tuned baselines.

    Args:
      config: the run's config (task, learned optimizer, ``eval`` section).
      theta: the learned optimizer's meta-parameters.
      settings: where to test; default :func:`settings_of` ``(config)``.
      stream: where progress goes (a bar on a terminal, lines otherwise); None: silent.

    Returns:
      One report per setting.
    """
    settings = settings_of(config) if settings is None else list(settings)
    thetas = {"learned": theta, "untrained": initial_theta(config)}
    units = _Units(len(settings) * _units_per_setting(len(thetas)), stream)
    try:
        return [evaluate_setting(config, s, thetas, units) for s in settings]
    finally:
        units.close()


# -- reports --------------------------------------------------------------------------------


def _fmt(value: float, width: int = 0) -> str:
    text = "diverged" if not math.isfinite(value) else f"{value:.4g}"
    return f"{text:>{width}}"


def format_reports(reports: Sequence[SettingReport]) -> str:
    """The tables popmeta prints: per setting, each optimizer's metrics, then the verdicts."""
    lines = []
    for report in reports:
        s = report.setting
        lines.append(
            f"{s.name}: {s.task.family}, {s.num_steps} inner steps, "
            f"{report.num_tasks} held-out tasks (mean ± 95% interval over tasks)"
        )
        metrics = [m for m in METRICS if report.scores["untrained"].metric(m) is not None]
        header = f"  {'optimizer':<12} {'lr':>8}" + "".join(f" {m:>24}" for m in metrics)
        lines.append(header)
        for name, scores in report.scores.items():
            lr = report.learning_rates.get(name)
            row = f"  {name:<12} {'-' if lr is None else f'{lr:.2g}':>8}"
            for m in metrics:
                mean, half_width = _mean_interval(scores.metric(m))
                cell = f"{_fmt(float(mean))} ± {_fmt(float(half_width))}"
                row += f" {cell:>24}"
            lines.append(row)
        if report.comparisons:
            lines.append(
                "  learned - baseline, paired by task (WIN: the interval favours the learned optimizer):"
            )
            for name in BASELINES:
                row = f"  {name:<12}"
                for m in metrics:
                    c = report.comparison(name, m)
                    cell = f"{c.difference:+.3g} ± {_fmt(c.half_width)} {c.verdict}"
                    row += f" {cell:>33}"
                lines.append(row)
        lines.append("")
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def _write_csv(reports: Sequence[SettingReport], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "setting",
                "task_family",
                "num_steps",
                "num_tasks",
                "optimizer",
                "learning_rate",
                "metric",
                "mean",
                "ci95_half_width",
                "learned_minus_optimizer",
                "difference_ci95_half_width",
                "verdict",
            ]
        )
        for report in reports:
            s = report.setting
            for name, scores in report.scores.items():
                for metric in METRICS:
                    values = scores.metric(metric)
                    if values is None:
                        continue
                    mean, half_width = _mean_interval(values)
                    c = report.comparison(name, metric)
                    writer.writerow(
                        [
                            s.name,
                            s.task.family,
                            s.num_steps,
                            report.num_tasks,
                            name,
                            report.learning_rates.get(name, ""),
                            metric,
                            float(mean),
                            float(half_width),
                            "" if c is None else c.difference,
                            "" if c is None else c.half_width,
                            "" if c is None else c.verdict,
                        ]
                    )


def _plot(reports: Sequence[SettingReport], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator

    fig, axes = plt.subplots(len(reports), 2, figsize=(11, 3.6 * len(reports)), squeeze=False)
    for row, report in zip(axes, reports, strict=True):
        for ax, (field, label) in zip(
            row, [("train_curve", "training loss"), ("test_curve", "test loss")], strict=True
        ):
            curves = {
                name: _mean_interval(getattr(scores, field))
                for name, scores in report.scores.items()
            }
            # The range is set by every optimizer but the untrained one, whose
            # curve would otherwise flatten the ones that matter; it is still drawn.
            ranged = [m[np.isfinite(m)] for name, (m, _) in curves.items() if name != "untrained"]
            values = np.concatenate(ranged) if ranged else np.array([])
            positive = values.size > 0 and values.min() > 0
            for name, (mean, half_width) in curves.items():
                steps = np.arange(1, mean.size + 1)
                (line,) = ax.plot(steps, mean, label=name, lw=1.8 if name == "learned" else 1.1)
                low = mean - half_width
                if positive:
                    low = np.maximum(low, values.min() / 2)
                ax.fill_between(steps, low, mean + half_width, color=line.get_color(), alpha=0.15)
            if values.size:
                low, high = values.min(), values.max()
                if positive:
                    ax.set_yscale("log")
                    ax.set_ylim(low / 1.3, high * 1.3)
                    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                    ax.yaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))
                    ax.yaxis.set_minor_formatter(plt.NullFormatter())
                else:
                    # Losses with additive noise can be negative: symmetric log.
                    ax.set_yscale("symlog", linthresh=1.0)
                    margin = 0.1 * (high - low)
                    ax.set_ylim(low - margin, high + margin)
            ax.set_xlabel("inner step")
            ax.set_ylabel(f"{label}, mean over tasks")
            ax.set_title(f"{report.setting.name} ({report.setting.task.family}): {label}")
            ax.grid(True, which="major", alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(reports: Sequence[SettingReport], out_dir: str | Path, title: str) -> EvalOutput:
    """Writes ``curves.png``, ``results.csv`` and TensorBoard curves under ``out_dir``.

    ``out_dir`` may be a storage URI (:mod:`popmeta.storage`): the files are
    written locally and uploaded once complete.
    """
    with local_output_dir(out_dir) as folder:
        for report in reports:
            for name, scores in report.scores.items():
                summaries = Summaries(folder / _slug(report.setting.name) / name)
                train_mean, _ = _mean_interval(scores.train_curve)
                test_mean, _ = _mean_interval(scores.test_curve)
                for step, (train, test) in enumerate(zip(train_mean, test_mean, strict=True)):
                    summaries.scalars(
                        step, {"eval/train_loss": float(train), "eval/test_loss": float(test)}
                    )
                summaries.close()
        _write_csv(reports, folder / "results.csv")
        _plot(reports, folder / "curves.png", title)
    return EvalOutput(
        png=join(out_dir, "curves.png"), csv=join(out_dir, "results.csv"), tensorboard=str(out_dir)
    )


class EvalWriteError(OSError):
    """The evaluation's output (PNG, CSV, TensorBoard curves) cannot be written where asked."""


def check_output_dir(out_dir: str | Path) -> None:
    """Raises :class:`EvalWriteError` if ``out_dir`` cannot take the evaluation's output.

    Checked before evaluating, so an unwritable place fails in a second, not
    after the whole evaluation. A storage URI must answer; a local directory
    is created and a file written and removed in it.
    """
    try:
        if is_remote(out_dir):
            RemoteDir(str(out_dir)).check_reachable()
            return
        folder = local_path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".popmeta-probe-"):
            pass
    except (OSError, StorageError) as err:
        raise EvalWriteError(f"cannot write the evaluation's output to {out_dir}: {err}") from None


def load_theta(checkpoint: str | Path) -> tuple[Config, Any]:
    """The config and theta stored in a training checkpoint."""
    metadata = read_checkpoint_metadata(checkpoint)
    if "config" not in metadata:
        raise ValueError(f"{checkpoint}: no config in the checkpoint's metadata")
    config = config_from_dict(metadata["config"], source=str(checkpoint))
    restored = load_checkpoint(checkpoint, Learner(config).checkpoint_tree())
    return config, restored.tree["theta"]


def evaluate_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path | None = None,
    stream: TextIO | None = sys.stderr,
    config_changes: Callable[[Config], Config] | None = None,
) -> tuple[list[SettingReport], EvalOutput]:
    """Meta-tests a training checkpoint in every setting its config names.

    Args:
      checkpoint: a ``ckpt_*.npz`` file (or a storage URI of one).
      out_dir: where the PNG, CSV and TensorBoard curves go; default ``eval/``
        beside the checkpoints directory (a storage URI works too).
      stream: progress display.
      config_changes: applied to the checkpoint's config before evaluating
        (e.g. other ``eval`` settings).

    Returns:
      The reports and where they were written.

    Raises:
      EvalWriteError: the output cannot be written (checked before evaluating).
    """
    with local_file(checkpoint) as local_checkpoint:
        config, theta = load_theta(local_checkpoint)
        name = local_checkpoint.name
    if config_changes is not None:
        config = config_changes(config)
    out = out_dir if out_dir else join(parent(parent(checkpoint)), "eval")
    check_output_dir(out)
    reports = evaluate(config, theta, stream=stream)
    try:
        return reports, write_reports(reports, out, f"{config.name}: {name}")
    except (OSError, StorageError) as err:
        raise EvalWriteError(f"cannot write the evaluation's output to {out}: {err}") from None


# -- during training ------------------------------------------------------------------------


class PeriodicEvaluator:
    """Evaluates the learned optimizer at the trained horizon in a background thread.

    The learner never waits for it: :meth:`submit` hands over a host copy of
    theta (the learner donates its buffers) only when the previous evaluation
    has been written, and skips otherwise; results are written by the
    caller's thread in :meth:`write_finished` (the event file has one writer),
    which the run loop calls before each :meth:`submit`. Only the
    learned optimizer runs here (no baselines), on the test tasks of the
    trained-horizon setting, so successive points are comparable.
    """

    def __init__(self, config: Config):
        self._run = _learned_optimizer_run(config, settings_of(config)[0])
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="popmeta-eval")
        # Only the caller's thread reads or replaces it; the worker thread only
        # completes the future.
        self._pending: tuple[int, Future[TaskScores]] | None = None
        self.skipped = 0

    def submit(self, step: int, theta: Any) -> bool:
        """Starts an evaluation of ``theta`` at ``step`` unless one is running or unwritten."""
        if self._pending is not None:
            self.skipped += 1
            return False
        host_theta = jax.tree.map(np.array, theta)
        self._pending = (step, self._executor.submit(lambda: _scores(self._run(host_theta))))
        return True

    def write_finished(self, summaries: Summaries, wait: bool = False) -> None:
        """Writes the finished evaluation, if any, under ``eval/`` at its step."""
        if self._pending is None or not (wait or self._pending[1].done()):
            return
        step, future = self._pending
        self._pending = None
        scores = future.result()
        values = {
            "eval/mean_train_loss": float(np.mean(scores.mean_train_loss)),
            "eval/final_test_loss": float(np.mean(scores.final_test_loss)),
        }
        if scores.final_test_accuracy is not None:
            values["eval/final_test_accuracy"] = float(np.mean(scores.final_test_accuracy))
        summaries.scalars(step, values)

    def close(self, summaries: Summaries | None = None) -> None:
        """Waits for the running evaluation, writes it if ``summaries`` is given, and stops."""
        if summaries is not None:
            self.write_finished(summaries, wait=True)
        self._executor.shutdown(wait=True)
