"""Meta-testing: the interval and verdict maths, tuning on disjoint tasks, output files, and
the background evaluation during training."""

from __future__ import annotations

import dataclasses
import io
import threading
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from scipy import stats

from popmeta.config import ConfigError, config_from_dict, config_to_dict, load_config
from popmeta.core.evaluation import training_curves
from popmeta.core.learned_optimizers import as_optax
from popmeta.core.optimizers import OptaxOptimizer
from popmeta.evaluate import (
    BASELINES,
    CSV_COLUMNS,
    LEARNING_RATES,
    BaselineCache,
    PeriodicEvaluator,
    ResultsTable,
    TaskScores,
    baselines,
    compare,
    evaluate,
    format_reports,
    paired_interval,
    read_evaluation,
    read_results_csv,
    settings_of,
    t_quantile_975,
    tune_baseline,
    write_reports,
)
from popmeta.evaluate.checkpoints import checked_rule_changes
from popmeta.evaluate.runs import learned_optimizer_run
from popmeta.experiment import (
    EstimatorSections,
    build_learned_optimizer,
    build_task_family,
    initial_theta,
)
from popmeta.run_loop import train
from popmeta.summaries import Summaries
from tests.events import read_scalars
from tests.local_run import local_config


def test_the_grid_has_four_points_per_decade_over_the_whole_range():
    assert LEARNING_RATES[0] == pytest.approx(1e-5) and LEARNING_RATES[-1] == pytest.approx(1.0)
    assert np.allclose(np.diff(np.log10(LEARNING_RATES)), 0.25)
    assert set(BASELINES) == {"adam", "adam_cosine", "sgdm", "sgd"}


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 15, 31, 63, 500])
def test_t_quantile_matches_student_t(df):
    assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=5e-4)


def test_the_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    n, trials, true_difference = 12, 4000, 0.3
    # Tasks differ a lot in scale; pairing removes that, only the small noise remains.
    task_scale = rng.lognormal(0.0, 1.0, (trials, n))
    baseline = task_scale + rng.normal(0.0, 0.2, (trials, n))
    learned = task_scale + true_difference + rng.normal(0.0, 0.2, (trials, n))
    covered = 0
    for a, b in zip(learned, baseline, strict=True):
        mean, half_width = paired_interval(a, b)
        covered += abs(mean - true_difference) <= half_width
    # Binomial(4000, 0.95) has a standard deviation of 0.0034.
    assert 0.94 <= covered / trials <= 0.96


def _scores(train_losses, accuracy=None, initial=None):
    train_losses = np.asarray(train_losses, np.float64)
    curve = train_losses[:, None]
    acc = None if accuracy is None else np.asarray(accuracy, np.float64)
    return TaskScores(train_losses, train_losses, acc, curve, curve, initial)


def test_verdicts_come_from_the_interval_and_respect_each_metric_direction():
    base = np.linspace(1.0, 2.0, 8)
    noise = np.array([0.01, -0.01, 0.02, -0.02, 0.01, -0.01, 0.0, 0.0])
    better = compare(_scores(base - 0.5 + noise), _scores(base), "adam")
    assert {c.verdict for c in better} == {"WIN"} and better[0].difference < 0
    worse = compare(_scores(base + 0.5 + noise), _scores(base), "adam")
    assert {c.verdict for c in worse} == {"LOSS"}
    same = compare(_scores(base + noise), _scores(base), "adam")
    assert {c.verdict for c in same} == {"TIE"}
    # Higher accuracy is the win, although the difference is positive.
    accurate = compare(
        _scores(base, accuracy=0.9 + noise), _scores(base, accuracy=0.5 + noise[::-1]), "adam"
    )
    by_metric = {c.metric: c.verdict for c in accurate}
    assert by_metric["final_test_accuracy"] == "WIN" and by_metric["mean_train_loss"] == "TIE"


def test_a_diverged_task_decides_against_the_side_that_diverged():
    base = np.linspace(1.0, 2.0, 8)
    diverged = base.copy()
    diverged[3] = np.inf
    assert compare(_scores(diverged), _scores(base), "sgd")[0].verdict == "LOSS"
    assert compare(_scores(base), _scores(diverged), "sgd")[0].verdict == "WIN"


def test_a_task_that_ends_above_its_start_makes_the_setting_unstable_and_a_loss():
    base = np.linspace(1.0, 2.0, 32)
    start = np.full(32, 2.5)
    good = base - 0.5
    assert (
        compare(_scores(good, initial=start), _scores(base, initial=start), "adam")[0].verdict
        == "WIN"
    )
    # One task of 32 blows up (to 40, not infinity): the mean still "wins" or ties, the
    # setting does not.
    blown = good.copy()
    blown[7] = 40.0
    comparison = compare(_scores(blown, initial=start), _scores(base, initial=start), "adam")[0]
    assert (comparison.verdict, comparison.unstable) == ("LOSS", 1)
    assert comparison.label == "LOSS (unstable 1)"
    nan_task = good.copy()
    nan_task[3] = np.inf
    assert _scores(nan_task, initial=start).unstable_tasks == 1
    # Only the learned optimizer's blow-ups make a setting unstable.
    assert (
        compare(_scores(good, initial=start), _scores(blown, initial=start), "adam")[0].unstable
        == 0
    )


def _eval_config(tmp_path, **eval_section):
    return local_config(
        tmp_path,
        task={"kind": "fixed_dim_quadratic_data", "dim": 4},
        eval={"num_tasks": 6, "num_steps": 12, "long_horizon_factors": [2], **eval_section},
    )


OOD = {"digits": {"kind": "image_mlp_digits"}}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """The trained horizon and an out-of-distribution setting, evaluated once for the module."""
    # The long horizon is evaluated by the CLI test; two settings keep this one short.
    tmp_path = tmp_path_factory.mktemp("eval")
    config = _eval_config(tmp_path, out_of_distribution=OOD, long_horizon_factors=[])
    progress = io.StringIO()
    reports = evaluate(config, initial_theta(EstimatorSections.of(config)), stream=progress)
    return config, reports, progress.getvalue()


def test_baselines_are_tuned_on_other_tasks_and_tested_on_the_learned_ones(evaluated):
    config, reports, _ = evaluated
    report = reports[0]
    assert report.setting.num_steps == 12 and report.num_tasks == 6
    # Same theta, same test tasks: the untrained and "learned" rows are identical.
    np.testing.assert_array_equal(
        report.scores["learned"].train_curve, report.scores["untrained"].train_curve
    )
    family = build_task_family(config.task)

    @jax.jit
    def adam_curves(lr, key):
        return training_curves(family, BASELINES["adam"](lr, 12), key, 6, 12)

    def mean_train_loss(lr, seed):
        return np.asarray(adam_curves(lr, jax.random.key(seed)).train_loss).mean()

    tuning = [mean_train_loss(np.float32(lr), config.eval.seed + 1) for lr in LEARNING_RATES]
    chosen = report.learning_rates["adam"]
    assert chosen == pytest.approx(LEARNING_RATES[int(np.nanargmin(tuning))])
    # The reported curve is the test tasks' at that learning rate, not the tuning tasks'.
    test = adam_curves(np.float32(chosen), jax.random.key(config.eval.seed))
    np.testing.assert_allclose(
        report.scores["adam"].train_curve, np.asarray(test.train_loss), rtol=1e-5
    )
    assert report.scores["adam"].mean_train_loss.mean() != pytest.approx(
        mean_train_loss(np.float32(chosen), config.eval.seed + 1)
    )
    # An untrained MLP optimizer barely moves: tuned Adam beats it on every metric.
    assert {c.verdict for c in report.comparisons if c.baseline == "adam"} == {"LOSS"}


def test_every_setting_is_reported_and_written(evaluated, tmp_path):
    _, reports, progress = evaluated
    assert [
        (s.name, s.num_steps) for s in settings_of(_eval_config(tmp_path, out_of_distribution=OOD))
    ] == [
        ("trained horizon", 12),
        ("2x horizon", 24),
        ("digits", 12),
    ]
    assert progress.count("\n") == 2 * (2 + len(BASELINES))
    assert all(r.scores["learned"].initial_test_loss is not None for r in reports)
    assert [r.setting.name for r in reports] == ["trained horizon", "digits"]
    digits = reports[1]
    # Labels give an accuracy, and its comparison; the quadratics have none.
    assert digits.scores["adam"].final_test_accuracy is not None
    assert digits.comparison("adam", "final_test_accuracy") is not None
    assert reports[0].scores["adam"].final_test_accuracy is None
    text = format_reports(reports)
    assert "digits: image_mlp_digits, 12 inner steps, 6 held-out tasks" in text
    assert "median | worst task" in text and "unstable" in text
    # Each row shows the mean, the median and the worst task, which is the highest loss.
    adam = digits.scores["adam"]
    worst = float(np.max(adam.final_test_loss))
    row = next(line for line in text.splitlines()[1 + len(digits.scores) + 8 :] if "adam " in line)
    assert f"{np.median(adam.final_test_loss):.4g} | {worst:.4g}" in row
    # The last line counts the settings that meet the bar against both Adams.
    met = [
        r.setting.name
        for r in reports
        if all(
            r.comparison(b, "mean_train_loss").verdict == "WIN"
            and r.comparison(b, "final_test_loss").verdict in ("WIN", "TIE")
            for b in ("adam", "adam_cosine")
        )
    ]
    missed = [r.setting.name for r in reports if r.setting.name not in met]
    bar = next(line for line in text.splitlines() if line.startswith("The bar"))
    assert f"is met in {len(met)} of 2 settings" in bar
    assert bar.endswith(f"; missed: {'; '.join(missed)}" if missed else "settings")
    written = write_reports(reports, tmp_path / "eval", "title")
    assert (tmp_path / "eval" / "curves.png").stat().st_size > 10_000
    assert written.csv.endswith("results.csv")
    lines = (tmp_path / "eval" / "results.csv").read_text().splitlines()
    # Header, then (optimizers x metrics) rows per setting; digits has accuracy too.
    assert len(lines) == 1 + 6 * 2 + 6 * 3
    assert lines[0].split(",") == list(CSV_COLUMNS)
    adam_accuracy = next(
        line.split(",")
        for line in lines
        if line.startswith("digits,") and ",adam," in line and "final_test_accuracy" in line
    )
    row = dict(zip(CSV_COLUMNS, adam_accuracy, strict=True))
    assert float(row["worst"]) == pytest.approx(float(np.min(adam.final_test_accuracy)))
    assert int(row["unstable_tasks"]) == adam.unstable_tasks
    scalars = read_scalars(tmp_path / "eval" / "digits" / "learned")
    assert [s for s, _ in scalars["eval/test_loss"]] == list(range(12))
    # `popmeta compare` reads the bar back from the CSV as the table counted it.
    read_back = read_evaluation(tmp_path / "eval")
    assert [s for s, o in read_back.outcomes.items() if o.criteria.met] == met
    assert read_back.outcomes["digits"].train_loss == pytest.approx(
        float(digits.scores["learned"].mean_train_loss.mean())
    )
    # Every verdict row reads back as the comparison it was written from (the untrained rule
    # loses these settings, so the bar above is met nowhere: the verdicts say more).
    table = ResultsTable.of(read_results_csv(tmp_path / "eval" / "results.csv"))
    for report in reports:
        for written in report.comparisons:
            read = table.comparison(report.setting.name, written.baseline, written.metric)
            assert read == pytest.approx(written)
    assert table.comparison("digits", "learned", "mean_train_loss") is None  # no verdict row


def test_the_background_evaluation_never_makes_the_learner_wait(tmp_path):
    config = _eval_config(tmp_path)
    evaluator = PeriodicEvaluator(learned_optimizer_run(config, settings_of(config)[0]))
    theta = initial_theta(EstimatorSections.of(config))
    summaries = Summaries(tmp_path / "events")
    gate = threading.Event()
    run = evaluator._run
    # Hold the first evaluation until the second submission has been refused.
    evaluator._run = lambda t: (gate.wait(60), run(t))[1]
    assert evaluator.submit(10, theta)
    assert not evaluator.submit(20, theta) and evaluator.skipped == 1
    evaluator.write_finished(summaries)  # not finished: nothing written, nothing waited for
    gate.set()
    evaluator.close(summaries)
    summaries.close()
    scalars = read_scalars(tmp_path / "events")
    assert [s for s, _ in scalars["eval/mean_train_loss"]] == [10]
    assert np.isfinite(scalars["eval/final_test_loss"][0][1])


def test_a_run_with_eval_every_logs_evaluations_under_eval(tmp_path):
    config = local_config(
        tmp_path,
        name="periodic",
        train={"num_steps": 12, "checkpoint_every": 100, "summary_every": 4},
        eval={"every": 4},
    )
    result = train(config, stream=io.StringIO())
    assert result.final_step == 12 and result.evaluation == []
    steps = [s for s, _ in read_scalars(tmp_path / "periodic")["eval/mean_train_loss"]]
    # Skipped while one runs, never queued; the last one is waited for at the end.
    assert steps and set(steps) <= {4, 8, 12} and steps == sorted(steps)


def test_each_training_family_of_a_mixture_gets_every_horizon(tmp_path):
    config = _eval_config(
        tmp_path,
        long_horizon_factors=[3, 10],
        each_training_family=True,
        out_of_distribution=OOD,
        optax_cosine=True,
    )
    config = dataclasses.replace(
        config,
        task=config_from_dict(
            {"task": {"kind": "quadratic", "mixture": {"quadratic": 1, "curved_quadratic": 1}}}
        ).task,
    )
    assert [(s.name, s.task.kind, s.num_steps) for s in settings_of(config)] == [
        ("quadratic: trained horizon", "quadratic", 12),
        ("quadratic: 3x horizon", "quadratic", 36),
        ("quadratic: 10x horizon", "quadratic", 120),
        ("curved_quadratic: trained horizon", "curved_quadratic", 12),
        ("curved_quadratic: 3x horizon", "curved_quadratic", 36),
        ("curved_quadratic: 10x horizon", "curved_quadratic", 120),
        ("digits", "image_mlp_digits", 12),
        ("trained horizon, through optax with cosine decay", "quadratic", 12),
    ]
    assert [s.through_optax_cosine for s in settings_of(config)] == [False] * 7 + [True]
    with pytest.raises(ConfigError, match=r"eval\.long_horizon_factors\[1\]: must be > 1"):
        config_from_dict({"eval": {"long_horizon_factors": [5, 1]}})


def test_coarse_to_fine_tuning_chooses_the_full_grids_learning_rate():
    """On the digits MLP at 40 steps, every baseline: 12 runs choose what 21 do."""
    family = build_task_family(local_config("runs", task={"kind": "image_mlp_digits"}).task)
    for name, make in BASELINES.items():
        full = tune_baseline(family, make, 4, 40, seed=3, tuning="full")
        coarse = tune_baseline(family, make, 4, 40, seed=3, tuning="coarse_to_fine")
        assert coarse.learning_rate == full.learning_rate, name
        np.testing.assert_array_equal(coarse.scores.train_curve, full.scores.train_curve)
        # Tuned on 2 tasks instead of 4: a rate at most one grid step away (SGDM's
        # best sits at the edge of divergence, where two tasks tell its
        # neighbours apart differently), scored on the same 4 test tasks.
        few = tune_baseline(family, make, 4, 40, seed=3, tuning="coarse_to_fine", tuning_tasks=2)
        steps = abs(np.log10(few.learning_rate / full.learning_rate)) * 4
        assert steps < 1.01, name
        assert few.scores.train_curve.shape == (4, 40)
        if few.learning_rate == full.learning_rate:
            np.testing.assert_array_equal(few.scores.train_curve, full.scores.train_curve)
    with pytest.raises(ConfigError, match=r"eval\.tuning_tasks: must be > 0"):
        config_from_dict({"eval": {"tuning_tasks": 0}})


def test_a_second_evaluation_reads_the_tuned_baselines_from_the_cache(tmp_path, monkeypatch):
    config = _eval_config(tmp_path, long_horizon_factors=[])
    cache = BaselineCache(tmp_path / "cache")
    first = evaluate(config, initial_theta(EstimatorSections.of(config)), baseline_cache=cache)
    entries = sorted((tmp_path / "cache").iterdir())
    assert len(entries) == len(BASELINES)

    def no_tuning(*args, **kwargs):
        raise AssertionError("a cached baseline was tuned again")

    monkeypatch.setattr("popmeta.evaluate.baselines.tune_baseline", no_tuning)
    second = evaluate(config, initial_theta(EstimatorSections.of(config)), baseline_cache=cache)
    for name in BASELINES:
        assert second[0].learning_rates[name] == first[0].learning_rates[name]
        for a, b in zip(second[0].scores[name], first[0].scores[name], strict=True):
            np.testing.assert_array_equal(a, b)
    assert [c.verdict for c in second[0].comparisons] == [c.verdict for c in first[0].comparisons]
    # Another horizon is another entry; refresh and a damaged entry tune again.
    with pytest.raises(AssertionError, match="tuned again"):
        evaluate(
            config,
            initial_theta(EstimatorSections.of(config)),
            [settings_of(config)[0]._replace(num_steps=13)],
            baseline_cache=cache,
        )
    with pytest.raises(AssertionError, match="tuned again"):
        evaluate(
            config,
            initial_theta(EstimatorSections.of(config)),
            baseline_cache=BaselineCache(cache.folder, True),
        )
    fewer = dataclasses.replace(config, eval=dataclasses.replace(config.eval, tuning_tasks=2))
    with pytest.raises(AssertionError, match="tuned again"):
        evaluate(fewer, initial_theta(EstimatorSections.of(config)), baseline_cache=cache)
    # Another CPU model rounds the same runs otherwise: its own entries.
    here = baselines._machine_description()
    assert here["backend"] == jax.default_backend() and here["cpu"]
    with monkeypatch.context() as elsewhere, pytest.raises(AssertionError, match="tuned again"):
        elsewhere.setattr(baselines, "_machine_description", lambda: {**here, "cpu": "another CPU"})
        evaluate(config, initial_theta(EstimatorSections.of(config)), baseline_cache=cache)
    entries[0].write_bytes(b"not an npz")
    with pytest.raises(AssertionError, match="tuned again"):
        evaluate(config, initial_theta(EstimatorSections.of(config)), baseline_cache=cache)


def test_the_optax_cosine_setting_runs_the_exported_optimizer_under_cosine_decay(tmp_path):
    config = local_config(
        tmp_path,
        learned_optimizer={"kind": "normalized_mlp", "initial_lr": 0.05, "hidden_size": 4},
        eval={"num_tasks": 3, "num_steps": 10, "optax_cosine": True, "long_horizon_factors": []},
    )
    plain, composed = settings_of(config)
    theta = initial_theta(EstimatorSections.of(config))
    lopt = build_learned_optimizer(config.learned_optimizer)
    cosine = optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, 10))
    by_hand = OptaxOptimizer(optax.chain(as_optax(lopt, theta, num_steps=10), cosine))
    family = build_task_family(config.task)
    expected = training_curves(family, by_hand, jax.random.key(config.eval.seed), 3, 10)
    got = learned_optimizer_run(config, composed)(theta)
    np.testing.assert_allclose(got.train_loss, expected.train_loss, rtol=1e-6)
    assert not np.allclose(got.train_loss, learned_optimizer_run(config, plain)(theta).train_loss)


def test_an_option_no_meta_parameter_stands_for_may_change_at_evaluation_and_no_other():
    trained = load_config(Path(__file__).parents[1] / "configs" / "generalist.yaml")
    theta = initial_theta(EstimatorSections.of(trained))

    def changes(override: str) -> list[str]:
        changed = config_from_dict(config_to_dict(trained), "the checkpoint's config", [override])
        return checked_rule_changes(
            trained.learned_optimizer, changed.learned_optimizer, theta, "ckpt.npz"
        )

    assert changes("learned_optimizer.loss_guard=0.01") == ["learned_optimizer.loss_guard=0.01"]
    assert changes("eval.num_tasks=4") == []
    with pytest.raises(
        ValueError, match=r"ckpt.npz: learned_optimizer.hidden_size=8 .*other shapes"
    ):
        changes("learned_optimizer.hidden_size=8")
