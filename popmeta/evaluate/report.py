"""The reports of a meta-test: the printed tables, ``results.csv``, ``curves.png``, TensorBoard.

Each optimizer's row gives, per metric, the mean over test tasks with its 95%
interval, the median task and the worst task (highest loss, lowest
accuracy), and the count of unstable tasks (final test loss above the initial
one, or not finite); the verdicts follow, per baseline and metric.
"""

from __future__ import annotations

import csv
import math
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from popmeta.evaluate.baselines import BASELINES
from popmeta.evaluate.runs import SettingReport
from popmeta.evaluate.statistics import (
    BAR_BASELINES,
    METRICS,
    Comparison,
    TaskScores,
    mean_interval,
    meets_bar,
)
from popmeta.storage import RemoteDir, StorageError, is_remote, join, local_output_dir, local_path
from popmeta.summaries import Summaries

__all__ = [
    "CSV_COLUMNS",
    "EvalOutput",
    "EvalWriteError",
    "ResultsTable",
    "check_output_dir",
    "format_reports",
    "read_results_csv",
    "write_reports",
]


class EvalOutput(NamedTuple):
    """Where :func:`write_reports` put its files."""

    png: str
    csv: str
    tensorboard: str


def _fmt(value: float, width: int = 0) -> str:
    text = "diverged" if not math.isfinite(value) else f"{value:.4g}"
    return f"{text:>{width}}"


def _summary(scores: TaskScores, metric: str) -> tuple[float, float, float, float]:
    """Mean, 95% half-width, median and worst task of ``metric``."""
    values = scores.metric(metric)
    mean, half_width = mean_interval(values)
    worst = np.min(values) if METRICS[metric] else np.max(values)
    return float(mean), float(half_width), float(np.median(values)), float(worst)


def format_reports(reports: Sequence[SettingReport]) -> str:
    """The tables popmeta prints: per setting, each optimizer's metrics, then the verdicts."""
    lines = []
    for report in reports:
        s = report.setting
        lines.append(
            f"{s.name}: {s.task.kind}, {s.num_steps} inner steps, {report.num_tasks} held-out "
            "tasks (mean ± 95% interval over tasks | median | worst task; unstable: tasks "
            "ending above their initial test loss or diverged)"
        )
        metrics = [m for m in METRICS if report.scores["untrained"].metric(m) is not None]
        header = f"  {'optimizer':<12} {'lr':>8} {'unstable':>8}"
        header += "".join(f" {m:>36}" for m in metrics)
        lines.append(header)
        for name, scores in report.scores.items():
            lr = report.learning_rates.get(name)
            row = f"  {name:<12} {'-' if lr is None else f'{lr:.2g}':>8}"
            row += f" {scores.unstable_tasks:>8}"
            for m in metrics:
                mean, half_width, median, worst = _summary(scores, m)
                cell = f"{_fmt(mean)} ± {_fmt(half_width)} | {_fmt(median)} | {_fmt(worst)}"
                row += f" {cell:>36}"
            lines.append(row)
        if report.comparisons:
            lines.append(
                "  learned - baseline, paired by task (WIN: the interval favours the learned "
                "optimizer; LOSS (unstable k): k of its tasks blew up):"
            )
            for name in BASELINES:
                row = f"  {name:<12}"
                for m in metrics:
                    c = report.comparison(name, m)
                    cell = f"{c.difference:+.3g} ± {_fmt(c.half_width)} {c.label}"
                    row += f" {cell:>36}"
                lines.append(row)
        lines.append("")
    bar = {
        r.setting.name: meets_bar(against)
        for r in reports
        if (against := [c for c in r.comparisons if c.baseline in BAR_BASELINES])
    }
    if bar:
        missed = [name for name, met in bar.items() if not met]
        lines.append(
            f"The bar (against {' and '.join(BAR_BASELINES)}: a WIN on mean_train_loss and "
            f"a WIN or TIE on final_test_loss) is met in {sum(bar.values())} of {len(bar)} "
            "settings" + (f"; missed: {'; '.join(missed)}" if missed else "")
        )
        lines.append("")
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


#: The columns of ``results.csv``.
CSV_COLUMNS = (
    "setting",
    "task_family",
    "num_steps",
    "num_tasks",
    "optimizer",
    "learning_rate",
    "metric",
    "mean",
    "ci95_half_width",
    "median",
    "worst",
    "unstable_tasks",
    "learned_minus_optimizer",
    "difference_ci95_half_width",
    "verdict",
)


def _write_csv(reports: Sequence[SettingReport], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for report in reports:
            s = report.setting
            for name, scores in report.scores.items():
                for metric in METRICS:
                    if scores.metric(metric) is None:
                        continue
                    c = report.comparison(name, metric)
                    writer.writerow(
                        [
                            s.name,
                            s.task.kind,
                            s.num_steps,
                            report.num_tasks,
                            name,
                            report.learning_rates.get(name, ""),
                            metric,
                            *_summary(scores, metric),
                            scores.unstable_tasks,
                            "" if c is None else c.difference,
                            "" if c is None else c.half_width,
                            "" if c is None else c.verdict,
                        ]
                    )


def read_results_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a ``results.csv`` that :func:`write_reports` wrote, as strings.

    Raises:
      ValueError: naming the file, when its columns are not :data:`CSV_COLUMNS`.
      OSError: when it cannot be read.
    """
    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
            raise ValueError(
                f"{path}: not a results.csv of `popmeta eval` (its columns are "
                f"{reader.fieldnames}; expected {', '.join(CSV_COLUMNS)})"
            )
        return list(reader)


class ResultsTable(NamedTuple):
    """The rows of a ``results.csv`` (:func:`read_results_csv`), found by setting, optimizer, metric.

    Attributes:
      settings: the settings, in the CSV's order.
      rows: each row by its ``(setting, optimizer, metric)``.
    """

    settings: list[str]
    rows: dict[tuple[str, str, str], dict[str, str]]

    @classmethod
    def of(cls, rows: Sequence[dict[str, str]]) -> ResultsTable:
        return cls(
            list(dict.fromkeys(r["setting"] for r in rows)),
            {(r["setting"], r["optimizer"], r["metric"]): r for r in rows},
        )

    def row(self, setting: str, optimizer: str, metric: str) -> dict[str, str] | None:
        return self.rows.get((setting, optimizer, metric))

    def comparison(self, setting: str, baseline: str, metric: str) -> Comparison | None:
        """``baseline``'s verdict row as the :class:`Comparison` it was written from (with the
        learned optimizer's unstable count in the setting), or None where it has no verdict."""
        row = self.row(setting, baseline, metric)
        if row is None or not row["verdict"]:
            return None
        learned = self.row(setting, "learned", metric)
        return Comparison(
            baseline,
            metric,
            float(row["learned_minus_optimizer"]),
            float(row["difference_ci95_half_width"]),
            row["verdict"],
            0 if learned is None else int(learned["unstable_tasks"]),
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
                name: mean_interval(getattr(scores, field))
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
            ax.set_title(f"{report.setting.name} ({report.setting.task.kind}): {label}")
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
                train_mean, _ = mean_interval(scores.train_curve)
                test_mean, _ = mean_interval(scores.test_curve)
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
