"""Meta-testing: a learned optimizer against tuned hand-designed baselines, with intervals.

:mod:`~popmeta.evaluate.runs` says where an optimizer is tested (settings) and
runs it there, :mod:`~popmeta.evaluate.baselines` tunes and caches the
baselines, :mod:`~popmeta.evaluate.statistics` scores tasks and compares
paired by task, :mod:`~popmeta.evaluate.report` prints and writes the
results, :mod:`~popmeta.evaluate.checkpoints` meta-tests a training checkpoint,
:mod:`~popmeta.evaluate.selection` chooses among a run's checkpoints on
validation tasks, :mod:`~popmeta.evaluate.side_by_side` sets evaluations
side by side and :mod:`~popmeta.evaluate.periodic` evaluates in the
background during training.
"""

from popmeta.evaluate.baselines import BASELINES, LEARNING_RATES, BaselineCache, tune_baseline
from popmeta.evaluate.checkpoints import evaluate_checkpoint, load_theta
from popmeta.evaluate.periodic import PeriodicEvaluator
from popmeta.evaluate.report import (
    CSV_COLUMNS,
    EvalOutput,
    EvalWriteError,
    ResultsTable,
    check_output_dir,
    format_reports,
    read_results_csv,
    write_reports,
)
from popmeta.evaluate.runs import (
    Setting,
    SettingReport,
    evaluate,
    evaluate_setting,
    learned_optimizer_run,
    settings_of,
    trained_horizon,
)
from popmeta.evaluate.selection import (
    BaselineValidation,
    CheckpointValidation,
    Selection,
    format_selection,
    run_checkpoints,
    run_of,
    select_checkpoint,
    write_selection,
)
from popmeta.evaluate.side_by_side import (
    Evaluation,
    SettingOutcome,
    format_side_by_side,
    read_evaluation,
)
from popmeta.evaluate.statistics import (
    BAR_BASELINES,
    METRICS,
    BarCriteria,
    Comparison,
    TaskScores,
    bar_criteria,
    compare,
    meets_bar,
    paired_interval,
    scores_of,
    t_quantile_975,
)

__all__ = [
    "BAR_BASELINES",
    "BASELINES",
    "CSV_COLUMNS",
    "LEARNING_RATES",
    "METRICS",
    "BarCriteria",
    "BaselineCache",
    "BaselineValidation",
    "CheckpointValidation",
    "Comparison",
    "EvalOutput",
    "EvalWriteError",
    "Evaluation",
    "PeriodicEvaluator",
    "ResultsTable",
    "Selection",
    "Setting",
    "SettingOutcome",
    "SettingReport",
    "TaskScores",
    "bar_criteria",
    "check_output_dir",
    "compare",
    "evaluate",
    "evaluate_checkpoint",
    "evaluate_setting",
    "format_reports",
    "format_selection",
    "format_side_by_side",
    "learned_optimizer_run",
    "load_theta",
    "meets_bar",
    "paired_interval",
    "read_evaluation",
    "read_results_csv",
    "run_checkpoints",
    "run_of",
    "scores_of",
    "select_checkpoint",
    "settings_of",
    "t_quantile_975",
    "trained_horizon",
    "tune_baseline",
    "write_reports",
    "write_selection",
]
