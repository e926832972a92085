"""Choosing among a run's checkpoints on validation tasks, never on the test tasks.

A run's checkpoints differ: 1,000 meta-training steps apart, the generalist's
met its bar in up to four settings more or fewer (docs/generalist.md), more
than its seeds differ. ``popmeta select`` runs each checkpoint's learned
optimizer in the settings ``popmeta eval`` tests (or those named) on
*validation* tasks: ``num_tasks`` tasks drawn from ``eval.seed + 1``, the
tasks the baselines' learning rates are tuned on (the same tasks when
``num_tasks`` is ``eval.tuning_tasks``, the default). The checkpoint, like the
baselines' learning rates, is chosen on tasks the evaluation never tests on.

A checkpoint's score is the geometric mean, over settings and over both
quantities, of its mean training loss (each task's loss averaged over the
curve, then averaged over tasks) and its final test loss (averaged over
tasks), so that every setting and both quantities count the same whatever
their loss scale (where a loss is negative, as a loss with additive noise
can be, the arithmetic mean stands in). Both, because ``popmeta eval``
judges both: over six seeds of the generalist, the candidate that trains
fastest on the validation tasks overfitted on one (docs/generalist.md,
"Choosing the checkpoint"), and reading the test loss too chose candidates
that met the bar in 85 settings of 102 against 80.

*Variants* are candidates too: the learned optimizer's options that no
meta-parameter stands for (a hand-designed brake, weight decay), set
otherwise, each run with every checkpoint on the same tasks, so that the
options are chosen on the validation tasks as the checkpoint is. The chosen
candidate has the fewest unstable validation tasks (final test loss above
the initial one, or not finite), then the lowest score, then the latest
step, then the rule without a variant.

Beside the candidates stand *references*: tuned Adam and tuned Adam with
cosine decay, each at the learning rate ``popmeta eval`` tunes for the
setting (the same cached entry, tuned here when absent), run on the same
validation tasks and scored the same way. A candidate *meets the bar* in a
setting when, paired by task against every reference, its mean training loss
is a WIN and its final test loss a WIN or TIE, with no unstable task: the
verdict ``popmeta eval`` gives on the test tasks. The validation tasks are the
ones the references' learning rates were chosen on, which favours the
references. A chosen candidate that scores no lower than a reference learned
less than tuning that baseline does, and the table says so: of fourteen
meta-trainings of the generalist (seven seeds, two rules), the two that
failed on the test tasks (5 and 6 of 17 settings) scored 0.1126 and 0.1091
where tuned Adam + cosine scores 0.1014, and the twelve others 0.0787 to
0.0927 (docs/generalist.md).

The checkpoints may come from several runs, such as the seeds of one config
(a user who meta-trained several chooses among all of them at once). Every
checkpoint is validated in the newest's settings, on its tasks and with its
rule options (after the ``--set`` changes), so the comparison is fair
whatever the other runs' configs; a checkpoint trained with other rule
options than the newest's would run otherwise than trained, and is refused,
naming the option.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np

from popmeta.config import Config, config_fields
from popmeta.evaluate.baselines import BASELINES, BaselineCache, TunedBaseline, tuning_seed
from popmeta.evaluate.checkpoints import checked_rule_changes, load_theta
from popmeta.evaluate.report import EvalWriteError, check_output_dir
from popmeta.evaluate.runs import UnitProgress, learned_optimizer_run, settings_of
from popmeta.evaluate.statistics import BAR_BASELINES, TaskScores, compare, meets_bar, scores_of
from popmeta.experiment import build_task_family
from popmeta.learner.checkpoints import checkpoint_step, is_checkpoint_name, list_checkpoints
from popmeta.storage import (
    RemoteDir,
    StorageError,
    is_remote,
    join,
    local_file,
    local_output_dir,
    parent,
)

__all__ = [
    "BaselineValidation",
    "CheckpointValidation",
    "Selection",
    "format_selection",
    "run_checkpoints",
    "run_of",
    "select_checkpoint",
    "write_selection",
]

SELECTION_CSV = "selection.csv"


class CheckpointValidation(NamedTuple):
    """One checkpoint on the validation tasks.

    Attributes:
      mean_train_loss: setting name -> mean over tasks of each task's mean training loss
        (infinite when a task diverged).
      final_test_loss: setting name -> mean over tasks of the test loss after the last step.
      unstable_tasks: over every setting, tasks whose final test loss is above their
        initial one or not finite.
      variant: the variant's name; empty for the rule without one.
      run: the run directory's name where the candidates come from several runs (its
        path where two runs share a name); else empty.
      settings_met: the settings where it meets the bar against every reference (the
        module docstring); None when no reference ran.
    """

    checkpoint: str
    step: int
    mean_train_loss: dict[str, float]
    final_test_loss: dict[str, float]
    unstable_tasks: int
    variant: str = ""
    run: str = ""
    settings_met: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        return _label(self.step, self.variant, self.run)

    @property
    def score(self) -> float:
        """The geometric mean over settings of ``mean_train_loss`` and ``final_test_loss``."""
        return _score([*self.mean_train_loss.values(), *self.final_test_loss.values()])


class BaselineValidation(NamedTuple):
    """A tuned baseline on the validation tasks: a reference the candidates should beat.

    Attributes:
      name: the baseline, as :data:`~popmeta.evaluate.baselines.BASELINES` names it.
      learning_rates: setting name -> the learning rate ``popmeta eval`` tunes for it.
      scores: setting name -> its per-task scores on the validation tasks.
    """

    name: str
    learning_rates: dict[str, float]
    scores: dict[str, TaskScores]

    @property
    def label(self) -> str:
        return f"tuned {self.name}"

    @property
    def mean_train_loss(self) -> dict[str, float]:
        return {name: float(np.mean(s.mean_train_loss)) for name, s in self.scores.items()}

    @property
    def final_test_loss(self) -> dict[str, float]:
        return {name: float(np.mean(s.final_test_loss)) for name, s in self.scores.items()}

    @property
    def unstable_tasks(self) -> int:
        return sum(s.unstable_tasks for s in self.scores.values())

    @property
    def score(self) -> float:
        """As a candidate's: the geometric mean over settings of both losses."""
        return _score([*self.mean_train_loss.values(), *self.final_test_loss.values()])


def _label(step: int, variant: str, run: str = "") -> str:
    return (f"{run} " if run else "") + f"step {step}" + (f", {variant}" if variant else "")


def run_of(checkpoint: str) -> str:
    """The run directory a checkpoint belongs to: above its ``checkpoints/``, else its folder."""
    folder = parent(checkpoint)  # never with a trailing "/"
    if posixpath.basename(folder) == "checkpoints":
        folder = parent(folder)
    return folder


def _run_names(checkpoints: Sequence[str]) -> dict[str, str]:
    """Each checkpoint's run as its columns are labelled: the run directory's name, its
    whole path where two runs share a name; empty for all when there is one run."""
    homes = {checkpoint: run_of(checkpoint) for checkpoint in checkpoints}
    if len(set(homes.values())) == 1:
        return dict.fromkeys(checkpoints, "")
    names = {checkpoint: posixpath.basename(home) for checkpoint, home in homes.items()}
    return names if len(set(names.values())) == len(set(homes.values())) else homes


def _options_otherwise(config: Config, newest: Config) -> str | None:
    """The first learned-optimizer option ``config`` sets otherwise than ``newest``, or None."""
    fields, newest_fields = config_fields(config), config_fields(newest)
    for name in sorted(set(fields) | set(newest_fields)):
        if name.startswith("learned_optimizer.") and fields.get(name) != newest_fields.get(name):
            return f"{name} is {fields.get(name)!r}, the newest's {newest_fields.get(name)!r}"
    return None


class Selection(NamedTuple):
    """Every candidate's validation (by run, then oldest checkpoint first), and which is chosen.

    Attributes:
      rule_changes: learned-optimizer options run otherwise than trained
        (``field=value``), variants aside.
      references: the tuned baselines on the same tasks (none: not run).
    """

    settings: list[str]
    num_tasks: int
    seed: int
    rule_changes: list[str]
    validations: list[CheckpointValidation]
    references: tuple[BaselineValidation, ...] = ()

    @property
    def chosen(self) -> CheckpointValidation:
        return min(
            self.validations, key=lambda v: (v.unstable_tasks, v.score, -v.step, bool(v.variant))
        )

    @property
    def outscored_by(self) -> BaselineValidation | None:
        """The best-scoring reference when the chosen candidate scores no lower, else None."""
        if not self.references:
            return None
        best = min(self.references, key=lambda r: r.score)
        return best if self.chosen.score >= best.score else None


def run_checkpoints(location: str | os.PathLike[str]) -> list[str]:
    """The checkpoints of a run directory (its ``checkpoints/``), oldest first.

    ``location`` may be the run directory, its ``checkpoints/`` folder, or a
    storage URI of either.

    Raises:
      FileNotFoundError: no checkpoint there.
    """
    location = os.fspath(location)
    if is_remote(location):
        remote = RemoteDir(location)
        folder = "checkpoints" if remote.exists("checkpoints") else ""
        names = [name for name in remote.files(folder) if is_checkpoint_name(name)]
        found = [join(location, folder, name) if folder else join(location, name) for name in names]
    else:
        folder = Path(location)
        inside = folder / "checkpoints"
        found = [str(path) for path in list_checkpoints(inside if inside.is_dir() else folder)]
    if not found:
        raise FileNotFoundError(
            f"{location}: no ckpt_<step>.npz checkpoints in it or in its checkpoints/ folder"
        )
    return sorted(found, key=lambda path: checkpoint_step(posixpath.basename(path)))


def select_checkpoint(
    checkpoints: Sequence[str | os.PathLike[str]],
    setting_names: Sequence[str] | None = None,
    num_tasks: int | None = None,
    config_changes: Callable[[Config], Config] | None = None,
    variants: Mapping[str, Callable[[Config], Config]] | None = None,
    stream: TextIO | None = None,
    references: Sequence[str] = BAR_BASELINES,
    baseline_cache: BaselineCache | None = None,
) -> Selection:
    """Validates every checkpoint (see the module docstring) and returns them all.

    Args:
      checkpoints: ``ckpt_*.npz`` files (or storage URIs) of one run or of several.
        The newest's config, after ``config_changes``, says what every checkpoint
        runs and where; each checkpoint's own rule options must be the same.
      setting_names: the settings to validate in, as ``popmeta eval`` names them;
        default every one.
      num_tasks: validation tasks per setting; default ``eval.tuning_tasks``
        (``eval.num_tasks`` when unset).
      config_changes: applied to the newest checkpoint's config (``eval`` fields,
        learned-optimizer options no meta-parameter stands for).
      variants: name -> a change of learned-optimizer options, applied after
        ``config_changes``; each is validated with every checkpoint too.
      stream: progress display.
      references: baselines run beside the candidates on the same tasks, at the
        learning rates ``popmeta eval`` tunes; empty: none.
      baseline_cache: where those learning rates are looked up and kept; default
        the user's (``$POPMETA_CACHE_DIR``, else ``~/.cache/popmeta``).

    Raises:
      ValueError: no checkpoints, an unknown setting or reference, a checkpoint
        whose theta cannot run as a candidate's config says or that was trained
        with other rule options than the newest (another run's), a variant that
        changes more than the learned optimizer's options, or fewer than 2 tasks.
    """
    if not checkpoints:
        raise ValueError("select: no checkpoints to choose from")
    unknown = [name for name in references if name not in BASELINES]
    if unknown:
        raise ValueError(
            f"select: no baseline {', '.join(map(repr, unknown))} to run beside the "
            f"candidates; popmeta's are {', '.join(map(repr, BASELINES))}"
        )
    steps = {os.fspath(c): checkpoint_step(posixpath.basename(os.fspath(c))) for c in checkpoints}
    ordered = sorted(steps, key=steps.__getitem__)
    trained, thetas = {}, {}
    for checkpoint in ordered:
        with local_file(checkpoint) as local:
            trained[checkpoint], thetas[checkpoint] = load_theta(local)
    newest = trained[ordered[-1]]
    config = newest if config_changes is None else config_changes(newest)
    configs = {"": config}
    for name, change in (variants or {}).items():
        if not name:
            raise ValueError("select: a variant needs a name; the empty one is the rule itself")
        configs[name] = change(config)
        if dataclasses.replace(configs[name], learned_optimizer=config.learned_optimizer) != config:
            raise ValueError(
                f"select: variant {name!r} changes more than learned_optimizer options"
            )
    # Every checkpoint must run as each candidate says; the newest's base changes are reported.
    changes = {
        (checkpoint, name): checked_rule_changes(
            trained[checkpoint].learned_optimizer,
            candidate.learned_optimizer,
            thetas[checkpoint],
            checkpoint,
        )
        for name, candidate in configs.items()
        for checkpoint in ordered
    }
    rule_changes = changes[ordered[-1], ""]
    for checkpoint in ordered[:-1]:
        own = trained[checkpoint] if config_changes is None else config_changes(trained[checkpoint])
        otherwise = _options_otherwise(own, config)
        if otherwise:
            raise ValueError(
                f"select: {checkpoint} was trained with other rule options than the newest, "
                f"{ordered[-1]}, and would run otherwise than trained: {otherwise}. Set the "
                "option alike for all with --set learned_optimizer.KEY=VALUE, or select them "
                "separately"
            )
    runs = _run_names(ordered)

    ev = config.eval
    tasks = num_tasks if num_tasks is not None else (ev.tuning_tasks or ev.num_tasks)
    if tasks < 2:
        raise ValueError(f"select: validation needs at least 2 tasks a setting, got {tasks}")
    on_validation_tasks = dataclasses.replace(ev, seed=tuning_seed(ev.seed), num_tasks=tasks)
    validation = {
        name: dataclasses.replace(candidate, eval=on_validation_tasks)
        for name, candidate in configs.items()
    }
    settings = {s.name: s for s in settings_of(validation[""])}
    names = list(settings) if not setting_names else list(setting_names)
    unknown = [name for name in names if name not in settings]
    if unknown:
        raise ValueError(
            f"select: no setting {', '.join(map(repr, unknown))}; the config's are "
            f"{', '.join(map(repr, settings))}"
        )

    candidates = [(checkpoint, name) for name in configs for checkpoint in ordered]
    scores: dict[tuple[str, str], dict[str, TaskScores]] = {c: {} for c in candidates}
    tuned: dict[str, dict[str, TunedBaseline]] = {name: {} for name in references}
    cache = BaselineCache() if baseline_cache is None else baseline_cache
    units = len(names) * (len(candidates) + len(references))
    progress = UnitProgress(units, stream, "select")
    try:
        # Settings outside, checkpoints inside: one compile per setting and variant
        # serves every theta.
        for setting in names:
            for variant, candidate_config in validation.items():
                run = learned_optimizer_run(candidate_config, settings[setting])
                for checkpoint in ordered:
                    scores[checkpoint, variant][setting] = scores_of(run(thetas[checkpoint]))
                    progress.step(
                        f"{setting}: {_label(steps[checkpoint], variant, runs[checkpoint])}"
                    )
            family = build_task_family(settings[setting].task)
            for name in references:
                reference = cache.tuned(
                    family,
                    settings[setting].task,
                    name,
                    ev.num_tasks,
                    settings[setting].num_steps,
                    ev.seed,
                    ev.tuning,
                    ev.tuning_tasks,
                    scored_on=(on_validation_tasks.seed, tasks),
                )
                tuned[name][setting] = reference
                progress.step(f"{setting}: tuned {name} (lr {reference.learning_rate:.2g})")
    finally:
        progress.close()

    baselines = tuple(
        BaselineValidation(
            name,
            {setting: t.learning_rate for setting, t in per_setting.items()},
            {setting: t.scores for setting, t in per_setting.items()},
        )
        for name, per_setting in tuned.items()
    )

    def validated(checkpoint: str, variant: str) -> CheckpointValidation:
        own = scores[checkpoint, variant]
        met = None
        if baselines:
            met = tuple(
                name
                for name in names
                if meets_bar(
                    [c for b in baselines for c in compare(own[name], b.scores[name], b.name)]
                )
            )
        return CheckpointValidation(
            checkpoint,
            steps[checkpoint],
            {name: float(np.mean(s.mean_train_loss)) for name, s in own.items()},
            {name: float(np.mean(s.final_test_loss)) for name, s in own.items()},
            sum(s.unstable_tasks for s in own.values()),
            variant,
            runs[checkpoint],
            met,
        )

    validations = [
        validated(checkpoint, variant)
        for checkpoint, variant in sorted(candidates, key=lambda c: (runs[c[0]], steps[c[0]]))
    ]
    return Selection(names, tasks, on_validation_tasks.seed, rule_changes, validations, baselines)


def _score(losses: Sequence[float]) -> float:
    """The geometric mean of ``losses`` (zero when one is zero); their mean when one
    is negative (a loss with additive noise can be); infinite when one is."""
    values = np.asarray(losses, np.float64)
    if not np.all(np.isfinite(values)):
        return math.inf
    if np.any(values < 0):
        return float(np.mean(values))
    if np.any(values == 0):
        return 0.0
    return float(np.exp(np.mean(np.log(values))))


def format_selection(selection: Selection) -> str:
    """The validation table: two rows per setting (training and test loss), a column per
    candidate and per reference, the chosen named and set against the references."""
    chosen = selection.chosen
    candidates, references = selection.validations, selection.references
    header = ["setting", *(v.label for v in candidates), *(r.label for r in references)]
    rows = []
    for short, quantity in (("train", "mean_train_loss"), ("test", "final_test_loss")):
        for name in selection.settings:
            losses = [getattr(v, quantity)[name] for v in candidates]
            best = min(losses)
            cells = [_cell(loss, loss == best) for loss in losses]
            cells += [_cell(getattr(r, quantity)[name], False) for r in references]
            rows.append([f"{name}: {short}", *cells])
    every = [*candidates, *references]
    rows.append(["unstable tasks", *(str(v.unstable_tasks) for v in every)])
    if references:
        count = len(selection.settings)
        met = [f"{len(v.settings_met or ())}/{count} " for v in candidates]
        rows.append(["settings meeting the bar", *met, *("- " for _ in references)])
    rows.append(
        ["score", *(_cell(v.score, v is chosen) for v in candidates)]
        + [_cell(r.score, False) for r in references]
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    title = (
        f"Validation on {selection.num_tasks} tasks of seed {selection.seed} per setting: "
        "mean training loss (train) and final test loss (test), * the lowest; score: the "
        "geometric mean of both over settings"
    )
    if selection.rule_changes:
        title += f", with {', '.join(selection.rule_changes)}"
    if references:
        title += (
            "; the tuned baselines at the learning rates popmeta eval tunes; the bar: against "
            "each, a WIN on training loss and a WIN or TIE on test loss, paired by task"
        )
    lines = [title]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    variant = f" with {chosen.variant}" if chosen.variant else ""
    lines.append(f"chosen: {chosen.checkpoint} (step {chosen.step}){variant}")
    beaten_by = selection.outscored_by
    if beaten_by is not None:
        lines.append(
            f"warning: the chosen candidate scores {chosen.score:.4g}, no lower than "
            f"{beaten_by.label}'s {beaten_by.score:.4g} on the same tasks: this meta-training "
            "learned less than tuning that baseline does; meta-train another seed"
        )
    return "\n".join(lines) + "\n"


def _cell(value: float, marked: bool) -> str:
    text = f"{value:.4g}" if math.isfinite(value) else "diverged"
    return f"{text}*" if marked else f"{text} "


def write_selection(selection: Selection, out_dir: str | os.PathLike[str]) -> str:
    """Writes ``selection.csv`` (a row per candidate, then one per reference, named in its
    ``baseline`` column) under ``out_dir``; returns its path.

    ``out_dir`` may be a storage URI.

    Raises:
      EvalWriteError: it cannot be written.
    """
    check_output_dir(out_dir)
    columns = ["step", "checkpoint", "variant", "chosen", "score", "unstable_tasks"]
    columns += ["num_tasks", "seed", "baseline", "settings_meeting_bar"]
    for name in selection.settings:
        columns += [f"{name}: mean_train_loss", f"{name}: final_test_loss"]
    chosen = selection.chosen

    def losses(v: CheckpointValidation | BaselineValidation) -> list[str]:
        train, test = v.mean_train_loss, v.final_test_loss
        return [f"{loss[name]:.6g}" for name in selection.settings for loss in (train, test)]

    try:
        with (
            local_output_dir(out_dir) as folder,
            open(folder / SELECTION_CSV, "w", newline="", encoding="utf-8") as file,
        ):
            writer = csv.writer(file)
            writer.writerow(columns)
            for v in selection.validations:
                row = [v.step, v.checkpoint, v.variant, v is chosen, f"{v.score:.6g}"]
                met = "" if v.settings_met is None else len(v.settings_met)
                row += [v.unstable_tasks, selection.num_tasks, selection.seed, "", met]
                writer.writerow(row + losses(v))
            for r in selection.references:
                row = ["", "", "", False, f"{r.score:.6g}", r.unstable_tasks]
                row += [selection.num_tasks, selection.seed, r.name, ""]
                writer.writerow(row + losses(r))
    except (OSError, StorageError) as err:
        raise EvalWriteError(f"cannot write the selection to {out_dir}: {err}") from None
    return join(out_dir, SELECTION_CSV)
