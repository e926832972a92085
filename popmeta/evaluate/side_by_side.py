"""Evaluations side by side: where each meets the bar, and what changed against the first.

An A/B probe of a learned-optimizer option (two meta-trainings, or one
checkpoint evaluated with and without an option at use) ends in two
``results.csv`` files. The counts of settings that meet the bar hide how
they moved: an option may gain three settings and lose three others, or
trade the training-loss half of the bar for the test-loss half.
:func:`format_side_by_side` lays the evaluations out per setting, each
setting's two halves (:func:`~popmeta.evaluate.statistics.bar_criteria`)
and the learned optimizer's mean losses, then counts, against the first
evaluation, the settings each half gained and lost.

The verdicts are each evaluation's own (learned optimizer against the
baselines on that evaluation's test tasks): a ``results.csv`` holds
summaries, not the per-task losses a paired test between two learned
optimizers would need. Where two evaluations' baselines differ in a setting
(other test tasks, tuning or horizon), the comparison says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

from popmeta.evaluate.report import ResultsTable, read_results_csv
from popmeta.evaluate.statistics import BAR_BASELINES, BarCriteria, bar_criteria

__all__ = ["Evaluation", "SettingOutcome", "format_side_by_side", "read_evaluation"]


class SettingOutcome(NamedTuple):
    """The learned optimizer in one setting of one evaluation.

    Attributes:
      criteria: the bar's two halves there.
      train_loss: its mean over test tasks of the mean training loss.
      test_loss: its mean over test tasks of the final test loss.
      unstable: its unstable tasks there.
      baselines: each bar baseline's (learning rate, mean training loss, mean
        test loss) as the CSV gives them: equal in two evaluations when both
        ran the same baselines on the same tasks.
    """

    criteria: BarCriteria
    train_loss: float
    test_loss: float
    unstable: int
    baselines: tuple[tuple[str, str, str], ...]


class Evaluation(NamedTuple):
    """One ``results.csv``: its path and each setting's outcome, in the CSV's order."""

    path: str
    outcomes: dict[str, SettingOutcome]

    @property
    def bar_met(self) -> int:
        return sum(o.criteria.met for o in self.outcomes.values())


def read_evaluation(path: str | Path) -> Evaluation:
    """Reads a ``results.csv`` that ``popmeta eval`` wrote, or the folder that holds one.

    Raises:
      ValueError: naming the file, when it is not such a CSV or lacks the
        learned optimizer's losses or the bar baselines' verdicts in a setting.
      OSError: when it cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    table = ResultsTable.of(read_results_csv(path))
    outcomes = {}
    for setting in table.settings:
        losses = {}
        for metric in ("mean_train_loss", "final_test_loss"):
            row = table.row(setting, "learned", metric)
            if row is None:
                raise ValueError(f"{path}: setting {setting!r} has no learned {metric} row")
            losses[metric] = row
        comparisons, baselines = [], []
        for baseline in BAR_BASELINES:
            train = table.comparison(setting, baseline, "mean_train_loss")
            test = table.comparison(setting, baseline, "final_test_loss")
            if train is None or test is None:
                raise ValueError(
                    f"{path}: setting {setting!r} lacks {baseline}'s verdicts (the bar is "
                    f"judged against {' and '.join(BAR_BASELINES)})"
                )
            comparisons += [train, test]
            train_row = table.row(setting, baseline, "mean_train_loss")
            test_row = table.row(setting, baseline, "final_test_loss")
            baselines.append((train_row["learning_rate"], train_row["mean"], test_row["mean"]))
        outcomes[setting] = SettingOutcome(
            criteria=bar_criteria(comparisons),
            train_loss=float(losses["mean_train_loss"]["mean"]),
            test_loss=float(losses["final_test_loss"]["mean"]),
            unstable=int(losses["mean_train_loss"]["unstable_tasks"]),
            baselines=tuple(baselines),
        )
    return Evaluation(str(path), outcomes)


def _cell(outcome: SettingOutcome | None) -> str:
    if outcome is None:
        return "-"
    train, test = outcome.criteria
    missed = [half for half, kept in (("train", train), ("test", test)) if not kept]
    status = "miss " + "+".join(missed) if missed else "met"
    unstable = f" (unstable {outcome.unstable})" if outcome.unstable else ""
    return f"{status}{unstable} {outcome.train_loss:.3g} / {outcome.test_loss:.3g}"


#: What :func:`_moves` counts, and how it reads it off a setting's criteria.
_HALVES = (
    ("bar", attrgetter("met")),
    ("training-loss half", attrgetter("train_loss")),
    ("test-loss half", attrgetter("test_loss")),
)


def _moves(first: Evaluation, other: Evaluation) -> str:
    """Settings ``other`` gained and lost against ``first``, per half of the bar and for the bar."""
    shared = [s for s in first.outcomes if s in other.outcomes]
    counts = []
    for name, holds in _HALVES:
        before = [holds(first.outcomes[s].criteria) for s in shared]
        after = [holds(other.outcomes[s].criteria) for s in shared]
        gained = sum(a and not b for a, b in zip(after, before, strict=True))
        lost = sum(b and not a for a, b in zip(after, before, strict=True))
        counts.append(f"{name} gained {gained}, lost {lost}")
    line = f"over the {len(shared)} settings both have: " + "; ".join(counts)
    differing = [s for s in shared if first.outcomes[s].baselines != other.outcomes[s].baselines]
    if differing:
        line += (
            f". The baselines differ from the first's in {len(differing)} of them (other test "
            "tasks, tuning or horizon): each verdict is its own evaluation's"
        )
    return line


def format_side_by_side(evaluations: Sequence[Evaluation]) -> str:
    """Each setting's bar halves per evaluation, the counts, and each against the first."""
    labels = [chr(ord("A") + i) if i < 26 else f"#{i + 1}" for i in range(len(evaluations))]
    lines = [f"{label}: {e.path}" for label, e in zip(labels, evaluations, strict=True)]
    lines += [
        "",
        f"Per setting, the bar's halves against {' and '.join(BAR_BASELINES)} (train: a WIN on "
        "mean_train_loss; test: a WIN or TIE on final_test_loss), then the learned optimizer's "
        "mean training loss / final test loss:",
    ]
    settings = list(dict.fromkeys(s for e in evaluations for s in e.outcomes))
    cells = [[_cell(e.outcomes.get(s)) for e in evaluations] for s in settings]
    name_width = max(len("setting"), *(len(s) for s in settings))
    widths = [max(len(labels[i]), *(len(row[i]) for row in cells)) for i in range(len(labels))]

    def line(first: str, rest: Sequence[str]) -> str:
        columns = [f"{c:<{w}}" for c, w in zip(rest, widths, strict=True)]
        return "  " + "  ".join([f"{first:<{name_width}}", *columns]).rstrip()

    lines.append(line("setting", labels))
    lines += [line(s, row) for s, row in zip(settings, cells, strict=True)]
    lines.append(line("bar met", [f"{e.bar_met} of {len(e.outcomes)}" for e in evaluations]))
    lines.append("")
    for label, other in zip(labels[1:], evaluations[1:], strict=True):
        lines.append(f"{label} against A, {_moves(evaluations[0], other)}")
    return "\n".join(lines).rstrip() + "\n"
