"""The real ``popmeta`` command: train, resume, interrupt, validate, bad input."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from popmeta.cli import main
from popmeta.learner.checkpoints import list_checkpoints, read_checkpoint_metadata
from tests.events import read_events, read_scalars

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "--set",
    "estimator.num_tasks=4",
    "--set",
    "truncation.length=30",
    "--set",
    "estimator.random_initial_iteration_offset=30",
    "--set",
    "eval.num_tasks=8",
    "--set",
    "eval.num_steps=30",
    "--set",
    "train.summary_every=5",
    "--set",
    "train.log_every=10",
]


def popmeta(*args, tmp_path, timeout=240, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "popmeta.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


TRAIN_ARGS = [
    "train",
    str(REPO / "configs" / "quickstart.yaml"),
    *SMALL,
    "--set",
    "name=cli",
    "--set",
    "train.num_steps=400",
    "--set",
    "train.checkpoint_every=100",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real ``popmeta train`` run of 400 sync steps on two Ray actors."""
    cwd = tmp_path_factory.mktemp("cli")
    result = popmeta(*TRAIN_ARGS, tmp_path=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, result


def test_train_meta_learns_and_keeps_the_terminal_clean(trained):
    _, result = trained
    assert "step 400/400" in result.stderr
    assert re.search(r"^2 actor\(s\) on 1 node\(s\), pinned to cores", result.stdout, re.M)
    # Ray's own start-up and worker logs stay out of the user's way.
    for noise in ("Started a local Ray instance", "INFO", "(EstimatorActor"):
        assert noise not in result.stdout and noise not in result.stderr, noise
    ratio = float(re.search(r"reaches ([\d.]+)x lower", result.stdout).group(1))
    assert ratio > 1.5, result.stdout  # clearly better than its untrained self


def test_train_writes_the_config_and_the_last_checkpoints(trained):
    run_dir = trained[0] / "runs" / "cli"
    assert (run_dir / "config.yaml").exists()
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert [int(p.stem.split("_")[1]) for p in checkpoints] == [200, 300, 400]
    assert read_checkpoint_metadata(checkpoints[-1])["config"]["train"]["num_steps"] == 400


def test_train_writes_the_full_tensorboard_tag_set(trained):
    run_dir = trained[0] / "runs" / "cli"
    scalars, histograms = read_events(run_dir)
    tags = [
        "meta_loss",
        "meta_loss_by_family/fixed_dim_quadratic_data",
        "grad_norm",
        "update_norm",
        "theta_norm",
        "learner_update_time",
        "estimates_per_s",
        "inner_steps_per_s",
        "inner_steps_per_s_by_actor/0",
        "inner_steps_per_s_by_actor/1",
        "staleness_mean",
        "staleness_max",
        "dropped_stale",
        "rejected_nonfinite",
        "live_actors",
    ]
    for tag in tags:
        assert tag in scalars, tag
    assert [s for s, _ in scalars["meta_loss"]] == list(range(5, 401, 5))

    def values(tag):
        return np.array([v for _, v in scalars[tag]])

    assert np.all(np.isfinite(values("meta_loss"))) and np.all(values("meta_loss") > 0)
    for tag in ("grad_norm", "update_norm", "theta_norm", "estimates_per_s", "inner_steps_per_s"):
        assert np.all(values(tag) > 0), tag
    assert np.all(values("live_actors") == 2)
    assert np.all(values("staleness_max") == 0)  # sync: every estimate is on the current theta
    assert np.all(values("rejected_nonfinite") == 0) and np.all(values("dropped_stale") == 0)
    per_actor = values("inner_steps_per_s_by_actor/0") + values("inner_steps_per_s_by_actor/1")
    assert np.all(per_actor >= values("inner_steps_per_s"))  # actors also idle while others work
    # Both actors' tasks (2 x 4) pooled into one phase histogram per summary.
    assert [n for _, n in histograms["trajectory_phase"]] == [8] * 80


def test_a_run_resumes_from_its_newest_checkpoint(trained, tmp_path):
    shutil.copytree(trained[0] / "runs", tmp_path / "runs")
    resumed = popmeta(*TRAIN_ARGS[:-4], "--set", "train.num_steps=420", tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 400" in resumed.stdout and "step 420/420" in resumed.stderr
    newest = list_checkpoints(tmp_path / "runs" / "cli" / "checkpoints")[-1]
    assert newest.name == "ckpt_00000420.npz"


def test_a_finished_run_says_so_and_a_changed_one_is_refused(trained, tmp_path):
    shutil.copytree(trained[0] / "runs", tmp_path / "runs")
    again = popmeta(*TRAIN_ARGS, tmp_path=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "already finished: step 400 of train.num_steps=400" in again.stdout
    assert "actor(s)" not in again.stdout  # no population, no Ray
    changed = popmeta(*TRAIN_ARGS, "--set", "estimator.kind=nres", tmp_path=tmp_path)
    assert changed.returncode == 2
    assert "estimator.kind: 'pes' -> 'nres'" in changed.stderr
    assert "Traceback" not in changed.stderr


def test_eval_compares_the_checkpoint_with_tuned_baselines(trained):
    run_dir = trained[0] / "runs" / "cli"
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    evaluated = popmeta("eval", str(newest), tmp_path=trained[0])
    assert evaluated.returncode == 0, evaluated.stderr
    rows = dict(re.findall(r"^(\S+).*?\s([\d.]+)\s+[\d.]+$", evaluated.stdout, re.M))
    assert {"learned", "untrained", "adam", "sgdm", "sgd"} <= set(rows)
    assert float(rows["learned"]) < float(rows["untrained"])
    assert (run_dir / "eval" / "curves.png").stat().st_size > 10_000
    assert len(read_scalars(run_dir / "eval" / "adam")["eval/train_loss"]) == 30


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_closes_the_run(tmp_path, signum):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "popmeta.cli",
            "train",
            *SMALL,
            "--set",
            "name=stop",
            "--set",
            "train.num_steps=100000",
            "--set",
            "train.log_every=1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        for line in proc.stderr:
            if line.startswith("step 20/") or time.time() > deadline:
                break
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in out
    for noise in ("Traceback", "PC: @", "SIGTERM received"):
        assert noise not in err, err[-2000:]
    checkpoints = list_checkpoints(tmp_path / "runs" / "stop" / "checkpoints")
    assert len(checkpoints) == 1 and int(checkpoints[0].stem.split("_")[1]) >= 20
    assert "meta_loss" in read_scalars(tmp_path / "runs" / "stop")


# The checks below call the CLI's entry point in this process: the same code as
# the console script, without paying for a Python start per case.


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", "--set", "estimator.std=0.05"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"std: 0\.05", out)
    assert "num_actors: 1" in out


@pytest.mark.parametrize(
    "overrides, messages",
    [
        (["estimator.stdd=0.1"], ["estimator.stdd"]),
        (["estimator.std=abc"], ["estimator.std"]),
        (["estimator.kind=sgd"], ["estimator.kind"]),
        (["train.num_steps=-3"], ["train.num_steps"]),
        (
            ["estimator.kind=full_es", "truncation.schedule=log_uniform"],
            ["estimator.kind", "truncation.schedule"],
        ),
        (["population.engine=local", "population.mode=async"], ["population.mode"]),
    ],
)
def test_bad_overrides_fail_before_anything_starts(
    tmp_path, monkeypatch, capsys, overrides, messages
):
    monkeypatch.chdir(tmp_path)

    def must_not_run(*args, **kwargs):
        raise AssertionError("training started despite a bad config")

    monkeypatch.setattr("popmeta.train.train", must_not_run)
    args = [arg for override in overrides for arg in ("--set", override)]
    for command in ("train", "validate"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        for message in messages:
            assert message in err, (command, err)
    assert not (tmp_path / "runs").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"popmeta \S+\n", capsys.readouterr().out)


def test_missing_config_file_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nope.yaml"]) == 2
    assert "nope.yaml" in capsys.readouterr().err
