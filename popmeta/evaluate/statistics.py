"""Per-task scores and the paired comparison of a learned optimizer with a baseline.

Each comparison is paired by task: the mean of ``learned - baseline`` with a
95% interval ``t(0.975, n-1) * sd / sqrt(n)`` over the ``n`` test tasks. The
verdict is WIN when the whole interval favours the learned optimizer (below
zero for losses, above zero for accuracy), LOSS when it favours the baseline,
TIE when it contains zero. A setting where any of the learned optimizer's
tasks ends with a test loss above its initial one, or not finite, is
*unstable*: every verdict there is LOSS, with the count of such tasks, since
a mean and its interval hide a few blow-ups among many good runs. A diverged
task scores an infinite loss. A setting meets *the bar* (:func:`meets_bar`)
when against tuned Adam and Adam + cosine its training loss is a WIN and its
test loss a WIN or TIE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from popmeta.core.evaluation import TrainingCurves

__all__ = [
    "BAR_BASELINES",
    "METRICS",
    "BarCriteria",
    "Comparison",
    "TaskScores",
    "bar_criteria",
    "compare",
    "mean_interval",
    "mean_train_losses",
    "meets_bar",
    "paired_interval",
    "scores_of",
    "t_quantile_975",
]

#: Metric name -> whether higher is better.
METRICS = {"mean_train_loss": False, "final_test_loss": False, "final_test_accuracy": True}
#: The baselines the bar is met against (:func:`meets_bar`).
BAR_BASELINES = ("adam", "adam_cosine")


class TaskScores(NamedTuple):
    """One optimizer's results on the held-out tasks of one setting.

    Attributes:
      mean_train_loss: ``[n]`` per task, the training loss averaged over the curve.
      final_test_loss: ``[n]`` per task, the test loss after the last step.
      final_test_accuracy: ``[n]`` per task, or None for tasks without labels.
      train_curve: ``[n, steps]`` training loss per step.
      test_curve: ``[n, steps]`` test loss after each step.
      initial_test_loss: ``[n]`` per task, the test loss at the initial
        parameters (None: not measured, so no task counts as unstable).
    """

    mean_train_loss: np.ndarray
    final_test_loss: np.ndarray
    final_test_accuracy: np.ndarray | None
    train_curve: np.ndarray
    test_curve: np.ndarray
    initial_test_loss: np.ndarray | None = None

    def metric(self, name: str) -> np.ndarray | None:
        return getattr(self, name)

    @property
    def unstable_tasks(self) -> int:
        """Tasks whose final test loss is not finite or above their initial test loss."""
        final = self.final_test_loss
        bad = ~np.isfinite(final)
        if self.initial_test_loss is not None:
            bad |= final > self.initial_test_loss
        return int(np.sum(bad))


class Comparison(NamedTuple):
    """``learned - baseline`` on one metric, paired by task.

    Attributes:
      unstable: the learned optimizer's unstable tasks in the setting (then the verdict is LOSS).
    """

    baseline: str
    metric: str
    difference: float
    half_width: float
    verdict: str  # WIN, TIE or LOSS, from the learned optimizer's side
    unstable: int = 0

    @property
    def label(self) -> str:
        """The verdict as tables print it: ``LOSS (unstable 3)`` names the count."""
        return f"{self.verdict} (unstable {self.unstable})" if self.unstable else self.verdict


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


def mean_interval(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean over ``axis`` and the 95% half-width of the t interval."""
    n = values.shape[axis]
    with np.errstate(invalid="ignore"):
        mean = values.mean(axis=axis)
        half_width = t_quantile_975(max(n - 1, 1)) * values.std(axis=axis, ddof=1) / math.sqrt(n)
    return mean, half_width


def paired_interval(learned: np.ndarray, baseline: np.ndarray) -> tuple[float, float]:
    """Mean of ``learned - baseline`` over tasks and its 95% half-width.

    Non-finite values make both infinite or NaN; :func:`compare` handles them.
    """
    diff = np.asarray(learned, np.float64) - np.asarray(baseline, np.float64)
    n = diff.size
    if n < 2:
        raise ValueError(f"an interval over tasks needs at least 2 tasks, got {n}")
    mean, half_width = mean_interval(diff)
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
    """``learned - baseline`` on every metric both have (see the module docstring)."""
    unstable = learned.unstable_tasks
    comparisons = []
    for metric, higher_is_better in METRICS.items():
        a, b = learned.metric(metric), baseline.metric(metric)
        if a is None or b is None:
            continue
        mean, half_width = paired_interval(a, b)
        verdict = "LOSS" if unstable else _verdict(a, b, mean, half_width, higher_is_better)
        comparisons.append(Comparison(name, metric, mean, half_width, verdict, unstable))
    return comparisons


class BarCriteria(NamedTuple):
    """The bar's two halves in one setting (:func:`bar_criteria`).

    Attributes:
      train_loss: a WIN on mean training loss against every baseline compared.
      test_loss: a WIN or TIE on final test loss against every one.
    """

    train_loss: bool
    test_loss: bool

    @property
    def met(self) -> bool:
        return self.train_loss and self.test_loss


def bar_criteria(comparisons: Sequence[Comparison]) -> BarCriteria:
    """Each half of the bar (:func:`meets_bar`) in one setting; neither without comparisons."""
    verdicts = {(c.baseline, c.metric): c.verdict for c in comparisons}
    baselines = {c.baseline for c in comparisons}
    if not baselines:
        return BarCriteria(train_loss=False, test_loss=False)
    return BarCriteria(
        train_loss=all(verdicts.get((b, "mean_train_loss")) == "WIN" for b in baselines),
        test_loss=all(verdicts.get((b, "final_test_loss")) in ("WIN", "TIE") for b in baselines),
    )


def meets_bar(comparisons: Sequence[Comparison]) -> bool:
    """Whether ``comparisons`` (of one setting, against each baseline to beat) show a WIN
    on mean training loss and a WIN or TIE on final test loss: the bar a learned
    optimizer meant to replace tuned Adam must clear. An unstable setting's verdicts are
    LOSSes, so it never meets it."""
    return bar_criteria(comparisons).met


def mean_train_losses(train_curves: np.ndarray) -> np.ndarray:
    """Each curve's mean over its last axis; infinite for a curve with a non-finite loss.

    A diverged task scores an infinite loss, never a NaN that compares false.
    """
    train = np.asarray(train_curves, np.float64)
    return np.where(np.all(np.isfinite(train), axis=-1), train.mean(axis=-1), np.inf)


def scores_of(curves: TrainingCurves) -> TaskScores:
    """The per-task scores of an optimizer's training curves."""
    train = np.asarray(curves.train_loss, np.float64)
    test = np.asarray(curves.eval_loss, np.float64)
    mean_train = mean_train_losses(train)
    final_test = np.where(np.isfinite(test[..., -1]), test[..., -1], np.inf)
    accuracy = None
    if curves.final_accuracy is not None:
        accuracy = np.nan_to_num(np.asarray(curves.final_accuracy, np.float64), nan=0.0)
    initial = None
    if curves.initial_eval_loss is not None:
        initial = np.asarray(curves.initial_eval_loss, np.float64)
    return TaskScores(mean_train, final_test, accuracy, train, test, initial)
