"""``popmeta select``: a run's checkpoint chosen on validation tasks, never on the test tasks."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popmeta.cli import main
from popmeta.config import config_to_dict
from popmeta.core.evaluation import training_curves
from popmeta.evaluate import BASELINES, BaselineCache, evaluate_setting, settings_of
from popmeta.evaluate.selection import (
    CheckpointValidation,
    Selection,
    run_checkpoints,
    select_checkpoint,
)
from popmeta.evaluate.statistics import TaskScores, compare, meets_bar, scores_of
from popmeta.experiment import build_learned_optimizer, build_task_family, learner_start
from popmeta.learner.checkpoint_layout import save_run_checkpoint
from popmeta.learner.learner import Learner
from tests.local_run import local_config

#: Learning rates of SGD on the quadratics: one barely moves, one trains, one blows up.
LEARNING_RATES = {100: 1e-4, 200: 0.1, 300: 50.0}
EVAL = {"num_tasks": 6, "tuning_tasks": 4, "num_steps": 12, "long_horizon_factors": [3]}


def _candidate_rows(path: Path) -> list[dict[str, str]]:
    """``selection.csv``'s candidate rows (the tuned baselines' rows name a baseline)."""
    with path.open() as file:
        return [row for row in csv.DictReader(file) if not row["baseline"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory whose three checkpoints hold SGD at the rates above."""
    root = tmp_path_factory.mktemp("select")
    config = local_config(root, name="chosen", eval=EVAL)
    start = Learner.of(learner_start(config)).checkpoint_tree()
    for step, lr in LEARNING_RATES.items():
        learner = start._replace(step=jnp.int32(step), theta={"log_lr": jnp.log(lr)})
        save_run_checkpoint(
            root / "chosen" / "checkpoints", learner, {}, config_to_dict(config), [], keep=None
        )
    return config, root / "chosen"


def test_the_checkpoint_that_trains_best_on_the_validation_tasks_is_chosen(run):
    _, run_dir = run
    checkpoints = run_checkpoints(run_dir)
    assert [c.rsplit("_", 1)[-1] for c in checkpoints] == [
        "00000100.npz",
        "00000200.npz",
        "00000300.npz",
    ]
    selection = select_checkpoint(checkpoints)
    slow, good, blown = selection.validations
    assert selection.settings == ["trained horizon", "3x horizon"]
    assert selection.chosen is good
    # The newest checkpoint blows up: never chosen, however its score reads.
    assert blown.unstable_tasks > 0 and slow.unstable_tasks == 0 == good.unstable_tasks
    assert good.score < slow.score
    losses = [*good.mean_train_loss.values(), *good.final_test_loss.values()]
    assert len(losses) == 4
    assert good.score == pytest.approx(math.exp(np.mean(np.log(losses))), rel=1e-12)


def _validation(step: int, train: float, test: float, unstable: int = 0) -> CheckpointValidation:
    settings = ["trained horizon", "5x horizon"]
    return CheckpointValidation(
        f"ckpt_{step:08d}.npz",
        step,
        dict.fromkeys(settings, train),
        dict.fromkeys(settings, test),
        unstable,
    )


def test_the_score_reads_the_test_loss_too_so_an_overfit_checkpoint_is_not_chosen():
    overfit = _validation(300, train=0.08, test=0.30)
    general = _validation(200, train=0.10, test=0.12)
    selection = Selection(["trained horizon", "5x horizon"], 8, 1, [], [general, overfit])
    assert selection.chosen is general
    assert general.score == pytest.approx(math.sqrt(0.10 * 0.12), rel=1e-12)
    # Fewer unstable tasks still come first, whatever the losses.
    blown = _validation(400, train=0.01, test=0.01, unstable=1)
    assert Selection(selection.settings, 8, 1, [], [blown, overfit]).chosen is overfit
    # A diverged setting scores infinite; a setting solved exactly, zero (the best).
    assert _validation(500, train=0.1, test=math.inf).score == math.inf
    assert _validation(600, train=0.1, test=0.0).score == 0.0
    # A negative loss (additive noise) has no geometric mean: the arithmetic one stands in.
    assert _validation(700, train=0.1, test=-0.05).score == pytest.approx(0.025)


def test_validation_runs_on_the_baselines_tuning_tasks_not_the_test_tasks(run):
    config, run_dir = run
    selection = select_checkpoint(run_checkpoints(run_dir), ["3x horizon"])
    # The tuning tasks: eval.tuning_tasks of them from eval.seed + 1 (baselines.tune_baseline).
    assert selection.num_tasks == 4 and selection.seed == config.eval.seed + 1
    family = build_task_family(config.task)
    sgd = build_learned_optimizer(config.learned_optimizer).opt_fn({"log_lr": jnp.log(0.1)})

    def mean_train_loss(seed: int, count: int) -> float:
        curves = training_curves(family, sgd, jax.random.key(seed), count, 36)
        return float(np.mean(np.asarray(curves.train_loss)))

    validated = selection.validations[1].mean_train_loss["3x horizon"]
    assert validated == pytest.approx(mean_train_loss(config.eval.seed + 1, 4), rel=1e-5)
    assert validated != pytest.approx(mean_train_loss(config.eval.seed, 6), rel=1e-3)


def test_tuned_adam_and_adam_cosine_run_beside_the_candidates_on_the_same_tasks(run, tmp_path):
    config, run_dir = run
    cache = BaselineCache(tmp_path)
    selection = select_checkpoint(run_checkpoints(run_dir), ["3x horizon"], baseline_cache=cache)
    # Each baseline's tuning (for `popmeta eval`) and its run on these tasks are cached ...
    entries = {path: path.stat().st_mtime_ns for path in tmp_path.glob("*.npz")}
    assert len(entries) == 4
    again = select_checkpoint(run_checkpoints(run_dir), ["3x horizon"], baseline_cache=cache)
    # ... and read, not run, the next time.
    assert {path: path.stat().st_mtime_ns for path in tmp_path.glob("*.npz")} == entries
    assert [r.score for r in again.references] == [r.score for r in selection.references]
    adam, adam_cosine = selection.references
    assert (adam.label, adam_cosine.label) == ("tuned adam", "tuned adam_cosine")
    # At the learning rates `popmeta eval` tunes in the setting ...
    setting = next(s for s in settings_of(config) if s.name == "3x horizon")
    report = evaluate_setting(config, setting, {}, baseline_cache=BaselineCache())
    assert adam.learning_rates == {"3x horizon": report.learning_rates["adam"]}
    assert adam_cosine.learning_rates == {"3x horizon": report.learning_rates["adam_cosine"]}
    # ... on the candidates' validation tasks, not the test tasks.
    family = build_task_family(config.task)
    adam_optimizer = BASELINES["adam"](report.learning_rates["adam"], 36)
    on_validation = scores_of(
        training_curves(family, adam_optimizer, jax.random.key(config.eval.seed + 1), 4, 36)
    )
    assert adam.mean_train_loss["3x horizon"] == pytest.approx(
        float(np.mean(on_validation.mean_train_loss)), rel=1e-5
    )
    assert adam.score == pytest.approx(
        math.sqrt(adam.mean_train_loss["3x horizon"] * adam.final_test_loss["3x horizon"])
    )
    # A candidate meets the bar where its paired verdicts against both say so.
    _, good, blown = selection.validations
    sgd = build_learned_optimizer(config.learned_optimizer).opt_fn({"log_lr": jnp.log(0.1)})
    good_scores = scores_of(
        training_curves(family, sgd, jax.random.key(config.eval.seed + 1), 4, 36)
    )
    met = _meets_bar(good_scores, adam.scores["3x horizon"], adam_cosine.scores["3x horizon"])
    assert good.settings_met == (("3x horizon",) if met else ())
    assert blown.settings_met == ()  # unstable tasks never meet it


def _meets_bar(learned: TaskScores, *references: TaskScores) -> bool:
    return meets_bar([c for i, r in enumerate(references) for c in compare(learned, r, str(i))])


def _scores(train, test, initial: float = 1.0) -> TaskScores:
    n = len(train)
    flat = np.zeros((n, 1))
    return TaskScores(np.asarray(train), np.asarray(test), None, flat, flat, np.full(n, initial))


def test_the_bar_is_a_training_loss_win_and_no_test_loss_loss_against_each_reference():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.3, 8)
    adam = _scores(base, base)
    noise = rng.normal(0.0, 0.01, 8)
    noise -= noise.mean()  # a difference of mean zero: a TIE, whatever its spread
    ahead = _scores(base - 0.05, base + noise)  # training loss: a WIN; test loss: a TIE
    assert _meets_bar(ahead, adam, adam)
    assert not _meets_bar(_scores(base + noise, base - 0.05), adam)  # training loss: a TIE
    assert not _meets_bar(_scores(base - 0.05, base + 0.05), adam)  # test loss: a LOSS
    assert not _meets_bar(ahead, adam, _scores(base - 0.1, base))  # behind one of them
    blown = _scores(base - 0.05, np.r_[base[:7], 2.0])  # a task ends above its initial loss
    assert not _meets_bar(blown, adam)
    assert not meets_bar([])  # nothing to meet it against


def test_a_run_that_learned_less_than_tuning_adam_does_is_named(run, tmp_path, capsys):
    _, run_dir = run
    slow = run_dir / "checkpoints" / "ckpt_00000100.npz"  # SGD at 1e-4 barely moves
    out = tmp_path / "slow"
    assert main(["select", str(slow), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tuned adam_cosine" in printed.splitlines()[1]  # a column of the table
    assert "settings meeting the bar" in printed and " 0/2 " in printed
    warning = printed.split("warning: ", 1)[1]
    assert (
        warning.startswith("the chosen candidate scores") and "meta-train another seed" in warning
    )
    with (out / "selection.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(r["baseline"], r["settings_meeting_bar"]) for r in rows] == [
        ("", "0"),
        ("adam", ""),
        ("adam_cosine", ""),
    ]
    assert min(float(r["score"]) for r in rows[1:]) <= float(rows[0]["score"])
    # Where --last left older checkpoints out, the warning says they may be ahead.
    assert main(["select", str(run_dir), "--last", "1", "--out", str(tmp_path / "last")]) == 0
    printed = capsys.readouterr().out
    assert "warning: " in printed
    assert "--last 1 left out 2 older checkpoint(s): select without --last" in printed
    # Without the baselines: no columns, no rows, no verdict.
    assert main(["select", str(slow), "--out", str(out), "--no-baselines"]) == 0
    printed = capsys.readouterr().out
    assert "tuned adam" not in printed and "warning" not in printed
    assert [r["baseline"] for r in _candidate_rows(out / "selection.csv")] == [""]
    with pytest.raises(ValueError, match="no baseline 'adamw'"):
        select_checkpoint([str(slow)], references=["adamw"])


def test_an_unknown_setting_or_too_few_tasks_is_named(run):
    _, run_dir = run
    with pytest.raises(ValueError, match=r"no setting '10x horizon'; the config's are "):
        select_checkpoint(run_checkpoints(run_dir), ["10x horizon"])
    with pytest.raises(ValueError, match="at least 2"):
        select_checkpoint(run_checkpoints(run_dir), num_tasks=1)


def test_select_prints_the_table_and_writes_the_csv(run, capsys):
    _, run_dir = run
    assert main(["select", str(run_dir), "--settings", "trained horizon", "--tasks", "3"]) == 0
    out = capsys.readouterr().out
    assert f"chosen: {run_dir / 'checkpoints' / 'ckpt_00000200.npz'} (step 200)" in out
    assert f"evaluate it: popmeta eval {run_dir / 'checkpoints' / 'ckpt_00000200.npz'}\n" in out
    assert "Validation on 3 tasks of seed" in out
    assert "trained horizon: train" in out and "trained horizon: test" in out
    rows = _candidate_rows(run_dir / "select" / "selection.csv")
    assert [(r["step"], r["chosen"]) for r in rows] == [
        ("100", "False"),
        ("200", "True"),
        ("300", "False"),
    ]
    assert float(rows[0]["trained horizon: mean_train_loss"]) > float(
        rows[1]["trained horizon: mean_train_loss"]
    )


def test_select_takes_a_runs_newest_checkpoints_only_when_asked(run, tmp_path, capsys):
    _, run_dir = run
    out = tmp_path / "last"
    args = ["select", str(run_dir), "--last", "1", "--settings", "trained horizon"]
    assert main([*args, "--out", str(out)]) == 0
    assert "(step 300)" in capsys.readouterr().out
    assert [row["step"] for row in _candidate_rows(out / "selection.csv")] == ["300"]
    assert main(["select", str(run_dir), "--last", "0"]) == 2
    assert "select --last 0: expected at least 1" in capsys.readouterr().err


def test_select_takes_checkpoint_files_and_rule_options(run, tmp_path, capsys):
    _, run_dir = run
    files = [str(p) for p in sorted((run_dir / "checkpoints").glob("ckpt_*.npz"))[:2]]
    args = ["select", *files, "--settings", "trained horizon", "--out", str(tmp_path / "two")]
    # An option no meta-parameter stands for runs as given, and the table says so.
    assert main([*args, "--set", "learned_optimizer.initial_lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "(step 200)" in out and "with learned_optimizer.initial_lr=0.5" in out
    # The command that evaluates the chosen one with the options it was chosen with.
    chosen = run_dir / "checkpoints" / "ckpt_00000200.npz"
    assert (
        f"evaluate it: popmeta eval {chosen} --set learned_optimizer.initial_lr=0.5 "
        f"--out {run_dir / 'eval_selected'}"
    ) in out
    rows = _candidate_rows(tmp_path / "two" / "selection.csv")
    assert [row["step"] for row in rows] == ["100", "200"]


def test_select_refuses_bad_input_before_running_anything(run, tmp_path, capsys):
    _, run_dir = run
    assert main(["select", str(tmp_path)]) == 2
    assert f"{tmp_path}: no ckpt_<step>.npz checkpoints" in capsys.readouterr().err
    assert main(["select", str(run_dir), "--set", "task.dim=5"]) == 2
    assert "select --set task.dim=5: only eval.* fields" in capsys.readouterr().err
    assert main(["select", str(run_dir), "--set", "learned_optimizer.initial_lr=0.5"]) == 2
    assert "give --out too" in capsys.readouterr().err
    assert main(["select", str(run_dir), "--settings", "5x horizon"]) == 2
    assert "no setting '5x horizon'" in capsys.readouterr().err


def test_a_checkpoint_of_another_rule_is_refused(run, tmp_path):
    _, run_dir = run
    other = local_config(tmp_path, name="other", learned_optimizer={"kind": "learnable_sgdm"})
    start = Learner.of(learner_start(other)).checkpoint_tree()
    written = save_run_checkpoint(
        tmp_path / "checkpoints",
        start._replace(step=jnp.int32(50)),
        {},
        config_to_dict(other),
        [],
        keep=None,
    )
    newest = run_checkpoints(run_dir)[-1]
    with pytest.raises(ValueError, match=r"learned_optimizer\.kind is 'learnable_sgdm'"):
        select_checkpoint([str(written), newest])


def test_a_variant_of_the_rules_options_is_a_candidate_on_the_same_tasks(tmp_path, capsys):
    lopt = {"kind": "normalized_mlp", "initial_lr": 0.05, "hidden_size": 4}
    config = local_config(tmp_path, name="variants", learned_optimizer=lopt, eval=EVAL)
    start = Learner.of(learner_start(config)).checkpoint_tree()
    for step in (1, 2):
        save_run_checkpoint(
            tmp_path / "variants" / "checkpoints",
            start._replace(step=jnp.int32(step)),
            {},
            config_to_dict(config),
            [],
            keep=None,
        )
    checkpoints = run_checkpoints(tmp_path / "variants")

    def decayed(config):
        options = {**config.learned_optimizer.options, "weight_decay": 5.0}
        lo = dataclasses.replace(config.learned_optimizer, options=options)
        return dataclasses.replace(config, learned_optimizer=lo)

    both = select_checkpoint(checkpoints, ["3x horizon"], variants={"weight_decay=5": decayed})
    assert [v.label for v in both.validations] == [
        "step 1",
        "step 1, weight_decay=5",
        "step 2",
        "step 2, weight_decay=5",
    ]
    plain, decayed_run = both.validations[2:]
    # The variant runs as if its options were the rule's, on the same validation tasks.
    alone = select_checkpoint(checkpoints[1:], ["3x horizon"], config_changes=decayed)
    assert decayed_run.mean_train_loss == alone.validations[0].mean_train_loss
    assert decayed_run.mean_train_loss != plain.mean_train_loss
    better = min((plain, decayed_run), key=lambda v: v.score)
    assert both.chosen is better  # the same theta at both steps: the latest step wins ties

    def elsewhere(config):
        return dataclasses.replace(config, eval=dataclasses.replace(config.eval, seed=9))

    with pytest.raises(ValueError, match="variant 'seed' changes more than learned_optimizer"):
        select_checkpoint(checkpoints, variants={"seed": elsewhere})

    args = ["select", str(tmp_path / "variants"), "--settings", "trained horizon"]
    assert main([*args, "--variant", "learned_optimizer.weight_decay=5"]) == 0
    out = capsys.readouterr().out
    assert "step 2, weight_decay=5" in out and "chosen: " in out
    variant_chosen = out.split("chosen: ", 1)[1].split("\n", 1)[0].endswith("with weight_decay=5")
    eval_line = out.split("evaluate it: ", 1)[1].split("\n", 1)[0]
    assert ("--set learned_optimizer.weight_decay=5" in eval_line) == variant_chosen
    rows = _candidate_rows(tmp_path / "variants" / "select" / "selection.csv")
    assert [row["variant"] for row in rows] == ["", "weight_decay=5"] * 2
    assert main([*args, "--variant", "eval.seed=3"]) == 2
    assert "expected learned_optimizer.KEY=VALUE" in capsys.readouterr().err


def _another_run(root, name: str, steps_and_rates: dict[int, float], config):
    """A run directory ``name`` under ``root`` of ``config`` holding SGD at the given rates."""
    config = dataclasses.replace(config, name=name, run_dir=str(root))
    start = Learner.of(learner_start(config)).checkpoint_tree()
    for step, lr in steps_and_rates.items():
        learner = start._replace(step=jnp.int32(step), theta={"log_lr": jnp.log(lr)})
        save_run_checkpoint(
            root / name / "checkpoints", learner, {}, config_to_dict(config), [], keep=None
        )
    return root / name


def test_the_seeds_of_one_config_are_chosen_among_at_once(run, tmp_path, capsys):
    config, run_dir = run
    # Another seed of the same config, whose checkpoint trains better than any of the run's.
    seed1 = _another_run(tmp_path, "seed1", {200: 0.5}, dataclasses.replace(config, seed=1))
    out = tmp_path / "both"
    args = ["select", str(run_dir), str(seed1), "--settings", "trained horizon", "3x horizon"]
    assert main(args) == 2  # whose run directory would the table go to?
    assert "the checkpoints come from 2 runs" in capsys.readouterr().err
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("setting"))
    labels = ["chosen step 100", "chosen step 200", "chosen step 300", "seed1 step 200"]
    assert [header.index(label) for label in labels] == sorted(header.index(x) for x in labels)
    assert f"chosen: {seed1 / 'checkpoints' / 'ckpt_00000200.npz'} (step 200)" in printed
    rows = _candidate_rows(out / "selection.csv")
    assert [(Path(row["checkpoint"]).parts[-3], row["chosen"]) for row in rows] == [
        ("chosen", "False"),
        ("chosen", "False"),
        ("chosen", "False"),
        ("seed1", "True"),
    ]
    # Each is validated on the same tasks as alone: the seed's run changes nothing.
    alone = select_checkpoint(run_checkpoints(seed1), ["trained horizon", "3x horizon"])
    assert float(rows[-1]["score"]) == pytest.approx(alone.validations[0].score, rel=1e-5)
    # Two runs of one name in different folders are told apart by their paths.
    twin = _another_run(tmp_path / "elsewhere", "seed1", {100: 0.1}, config)
    both = select_checkpoint([*run_checkpoints(seed1), *run_checkpoints(twin)], ["3x horizon"])
    assert sorted(v.run for v in both.validations) == sorted([str(seed1), str(twin)])


def test_other_runs_are_validated_as_the_newest_and_other_rule_options_refused(run, tmp_path):
    config, run_dir = run
    newest = run_checkpoints(run_dir)[-1]
    # A run evaluated elsewhere (other horizons, another evaluation seed) is validated in
    # the newest's settings, on its tasks, as every candidate is.
    elsewhere = dataclasses.replace(
        config, eval=dataclasses.replace(config.eval, long_horizon_factors=(4,), seed=7)
    )
    other = _another_run(tmp_path, "elsewhere", {100: 0.1}, elsewhere)
    both = select_checkpoint([*run_checkpoints(other), newest])
    assert both.seed == config.eval.seed + 1 and both.settings == ["trained horizon", "3x horizon"]
    assert [v.run for v in both.validations] == ["chosen", "elsewhere"]

    options = {**config.learned_optimizer.options, "initial_lr": 0.5}
    other_rule = dataclasses.replace(
        config,
        learned_optimizer=dataclasses.replace(config.learned_optimizer, options=options),
    )
    rule = _another_run(tmp_path, "rule", {100: 0.1}, other_rule)
    with pytest.raises(ValueError, match=r"rule.*other rule options.*initial_lr is 0\.5"):
        select_checkpoint([*run_checkpoints(rule), newest], ["trained horizon"])

    # Set alike for every checkpoint, the option no longer tells them apart.
    def alike(config):
        lo = dataclasses.replace(config.learned_optimizer, options=options)
        return dataclasses.replace(config, learned_optimizer=lo)

    chosen = select_checkpoint(
        [*run_checkpoints(rule), newest], ["trained horizon"], config_changes=alike
    ).chosen
    assert Path(chosen.checkpoint).parts[-3] == "rule" and chosen.run == "rule"
