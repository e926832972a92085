"""The real ``popmeta`` command: train, resume, interrupt, validate, bad input."""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from popmeta.cli import main
from popmeta.learner.checkpoint_file import read_checkpoint_metadata
from popmeta.learner.checkpoints import list_checkpoints
from tests.events import read_events, read_scalars
from tests.processes import env_with_compilation_cache

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
        env=env_with_compilation_cache(),
        **kwargs,
    )


TRAIN_ARGS = [
    "train",
    str(REPO / "configs" / "quickstart.yaml"),
    *SMALL,
    "--set",
    "name=cli",
    "--set",
    "train.num_steps=200",
    "--set",
    "train.checkpoint_every=50",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real ``popmeta train`` run of 200 sync steps on two Ray actors."""
    cwd = tmp_path_factory.mktemp("cli")
    result = popmeta(*TRAIN_ARGS, tmp_path=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, result


def test_train_meta_learns_and_keeps_the_terminal_clean(trained):
    _, result = trained
    assert "step 200/200" in result.stderr
    assert re.search(r"^2 actor\(s\) on 1 node\(s\), pinned to cores", result.stdout, re.M)
    # Ray's own start-up and worker logs stay out of the user's way.
    for noise in ("Started a local Ray instance", "INFO", "(EstimatorActor"):
        assert noise not in result.stdout and noise not in result.stderr, noise
    table = _mean_train_losses(result.stdout, "trained horizon")
    assert set(table) == {"learned", "untrained", "adam", "adam_cosine", "sgdm", "sgd"}
    assert table["learned"] < table["untrained"], result.stdout  # it meta-learned something
    # Every baseline is compared with the learned optimizer, with a verdict.
    assert len(re.findall(r"[+-][\d.e+-]+ ± \S+ (WIN|TIE|LOSS)", result.stdout)) == 4 * 2


def _mean_train_losses(stdout: str, setting: str) -> dict[str, float]:
    """Optimizer -> mean training loss, from the printed table of one setting."""
    block = stdout[stdout.index(f"{setting}:") :].split("\n\n")[0]
    # A row: name, lr, unstable tasks, then per metric "mean ± half-width | median | worst".
    rows = re.findall(r"^  (\w+) +\S+ +\d+ +(\S+) ± \S+ \| ", block, re.M)
    return {name: float(value) for name, value in rows if name != "optimizer"}


def test_train_writes_the_config_and_the_last_checkpoints(trained):
    run_dir = trained[0] / "runs" / "cli"
    assert (run_dir / "config.yaml").exists()
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert [int(p.stem.split("_")[1]) for p in checkpoints] == [100, 150, 200]
    recorded = read_checkpoint_metadata(checkpoints[-1])["config"]
    assert recorded["train"]["num_steps"] == 200
    # The quickstart's `truncations_per_call: auto`, measured, said and recorded.
    chosen = recorded["estimator"]["truncations_per_call"]
    assert isinstance(chosen, int) and chosen >= 1
    assert f"estimator.truncations_per_call: auto -> {chosen} " in trained[1].stdout
    assert f"truncations_per_call: {chosen}\n" in (run_dir / "config.yaml").read_text()
    assert f"trunc/call={chosen} " in trained[1].stderr


def test_train_writes_the_full_tensorboard_tag_set(trained):
    run_dir = trained[0] / "runs" / "cli"
    scalars, histograms = read_events(run_dir)
    tags = [
        "meta_loss",
        "meta_loss_by_family/curved_quadratic",
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
        "truncations_per_call",
    ]
    for tag in tags:
        assert tag in scalars, tag
    assert [s for s, _ in scalars["meta_loss"]] == list(range(5, 201, 5))

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
    assert [n for _, n in histograms["trajectory_phase"]] == [8] * 40


def test_a_run_resumes_from_its_newest_checkpoint(trained, tmp_path):
    shutil.copytree(trained[0] / "runs", tmp_path / "runs")
    # The evaluation at the end is the trained fixture's to test; eval.* may change on a resume.
    resumed = popmeta(
        *TRAIN_ARGS[:-4],
        "--set",
        "train.num_steps=220",
        "--set",
        "eval.after_training=false",
        tmp_path=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 200" in resumed.stdout and "step 220/220" in resumed.stderr
    newest = list_checkpoints(tmp_path / "runs" / "cli" / "checkpoints")[-1]
    assert newest.name == "ckpt_00000220.npz"


def test_a_finished_run_says_so_and_a_changed_one_is_refused(trained, tmp_path):
    shutil.copytree(trained[0] / "runs", tmp_path / "runs")
    again = popmeta(*TRAIN_ARGS, tmp_path=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "already finished: step 200 of train.num_steps=200" in again.stdout
    assert "actor(s)" not in again.stdout  # no population, no Ray
    changed = popmeta(*TRAIN_ARGS, "--set", "estimator.kind=nres", tmp_path=tmp_path)
    assert changed.returncode == 2
    assert "estimator.kind: 'pes' -> 'nres'" in changed.stderr
    assert "Traceback" not in changed.stderr


def test_eval_compares_the_checkpoint_with_tuned_baselines(trained):
    run_dir = trained[0] / "runs" / "cli"
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    evaluated = popmeta(
        "eval", str(newest), "--set", "eval.long_horizon_factors=[2]", tmp_path=trained[0]
    )
    assert evaluated.returncode == 0, evaluated.stderr
    for setting in ("trained horizon", "2x horizon"):
        table = _mean_train_losses(evaluated.stdout, setting)
        assert set(table) == {"learned", "untrained", "adam", "adam_cosine", "sgdm", "sgd"}
        assert table["learned"] < table["untrained"]
    # Progress while it runs, then where everything went.
    assert "eval 12/12" in evaluated.stderr
    eval_dir = run_dir / "eval"
    assert f"curves (PNG): {eval_dir / 'curves.png'}" in evaluated.stdout
    assert (eval_dir / "curves.png").stat().st_size > 10_000
    with (eval_dir / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    verdicts = [r for r in rows if r["verdict"]]
    assert len(verdicts) == 2 * 4 * 2  # settings x baselines x (train, test) losses
    assert {r["verdict"] for r in verdicts} <= {"WIN", "TIE", "LOSS"}
    assert all(float(r["learning_rate"]) > 0 for r in rows if r["optimizer"] == "adam")
    curves = read_scalars(eval_dir / "trained_horizon" / "adam")
    assert len(curves["eval/train_loss"]) == 30 and len(curves["eval/test_loss"]) == 30
    assert len(read_scalars(eval_dir / "2x_horizon" / "learned")["eval/train_loss"]) == 60


def test_select_chooses_among_the_checkpoints_train_kept(trained, capsys):
    cwd, result = trained
    run_dir = cwd / "runs" / "cli"
    assert "`popmeta select runs/cli` chooses among the checkpoints it kept" in result.stdout
    assert main(["select", str(run_dir), "--settings", "trained horizon", "--tasks", "3"]) == 0
    out = capsys.readouterr().out
    kept = [path.name for path in list_checkpoints(run_dir / "checkpoints")]
    assert len(kept) == 3 and all(f"step {int(name[5:13])}" in out for name in kept)
    assert re.search(r"^chosen: .*ckpt_\d{8}\.npz \(step \d+\)$", out, re.M)
    assert (run_dir / "select" / "selection.csv").exists()


def test_eval_refuses_to_change_what_was_trained(trained, capsys):
    newest = list_checkpoints(trained[0] / "runs" / "cli" / "checkpoints")[-1]
    assert main(["eval", str(newest), "--set", "task.dim=3"]) == 2
    assert "only eval.* fields and learned-optimizer options" in capsys.readouterr().err
    reshaped = ["--set", "learned_optimizer.hidden_size=7"]
    assert main(["eval", str(newest), *reshaped]) == 2
    assert "give --out too" in capsys.readouterr().err
    assert main(["eval", str(newest), *reshaped, "--out", str(trained[0] / "changed")]) == 2
    refused = capsys.readouterr().err
    assert "learned_optimizer.hidden_size=7 gives the learned optimizer meta-parameters" in refused
    assert not (trained[0] / "changed").exists()


def _endless_run(tmp_path, name: str) -> subprocess.Popen:
    """A real ``popmeta train`` that runs until stopped, logging every step to stderr."""
    args = [*SMALL, "--set", f"name={name}", "--set", "train.num_steps=100000"]
    return subprocess.Popen(
        [sys.executable, "-m", "popmeta.cli", "train", *args, "--set", "train.log_every=1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_compilation_cache(),
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_closes_the_run(tmp_path, signum):
    proc = _endless_run(tmp_path, "stop")
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


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmdline = (Path("/proc") / str(child) / "cmdline").read_bytes()
            except OSError:
                continue
            found.append((child, cmdline.replace(b"\0", b" ").decode(errors="replace")))
            todo.append(child)
    return found


def test_an_actor_death_is_reported_in_popmeta_words_only(tmp_path):
    proc = _endless_run(tmp_path, "death")
    seen = []
    try:
        deadline = time.time() + 120
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("step 10/") or time.time() > deadline:
                break
        actors = [pid for pid, cmd in _descendants(proc.pid) if "EstimatorActor" in cmd]
        assert actors, "the run's actor processes are found"
        os.kill(actors[0], signal.SIGKILL)
        for line in proc.stderr:
            seen.append(line)
            if "was lost" in line or time.time() > deadline:
                break
        # Some rounds after the loss, for Ray's death notice to reach the driver.
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("step 60/") or time.time() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-2000:]
    assert re.search(r"actor \d \(restart 0\) was lost", err), err[-2000:]
    for noise in ("(raylet)", "A worker died", "\x1b[", "Traceback"):
        assert noise not in out and noise not in err, noise


# The checks below call the CLI's entry point in this process: the same code as
# the console script, without paying for a Python start per case.


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", "--set", "estimator.std=0.05"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"std: 0\.05", out)
    assert "num_actors: 2" in out  # the quickstart's, which are the defaults


@pytest.mark.parametrize(
    "overrides, messages",
    [
        (["estimator.stdd=0.1"], ["estimator.stdd"]),
        (["estimator.std=abc"], ["estimator.std"]),
        (["estimator.kind=sgd"], ["estimator.kind"]),
        (["train.num_steps=-3"], ["train.num_steps"]),
        (
            ["estimator.kind=full_es", "truncation.kind=log_uniform"],
            ["estimator.kind", "truncation.kind"],
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

    monkeypatch.setattr("popmeta.run_loop.train", must_not_run)
    args = [arg for override in overrides for arg in ("--set", override)]
    for command in ("train", "validate"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        for message in messages:
            assert message in err, (command, err)
    assert not (tmp_path / "runs").exists()


def test_fields_a_kind_checks_against_each_other_fail_validate_as_they_fail_train(
    tmp_path, monkeypatch, capsys
):
    """A kind's own checks across its fields run when it is built: validate builds what train does."""
    monkeypatch.chdir(tmp_path)
    args = ["--set", "learned_optimizer.kind=normalized_mlp"]
    args += ["--set", "learned_optimizer.loss_guard_relative=0.5"]  # without loss_guard
    for command in ("validate", "train"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        for message in ("learned_optimizer", "loss_guard_relative", "needs loss_guard"):
            assert message in err, (command, err)
    assert not (tmp_path / "runs").exists()


def test_the_local_engine_splits_its_tasks_over_the_cpu_devices_it_asks_for(
    tmp_path, monkeypatch, capsys
):
    args = [str(REPO / "configs" / "quickstart.yaml"), *SMALL, "--set", "train.num_steps=10"]
    args += ["--set", "population.engine=local", "--set", "population.cpu_devices=2"]
    args += ["--set", "eval.after_training=false"]
    # A fresh process: the driver starts JAX with two CPU devices.
    result = popmeta("train", *args, "--set", "name=split", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"^2 worker\(s\) in this process, .*\(local engine\), tasks split over 2 devices$",
        result.stdout,
        re.M,
    ), result.stdout
    assert "step 10/10" in result.stderr
    assert list_checkpoints(tmp_path / "runs" / "split" / "checkpoints")
    # Once JAX runs in a process, its device count is fixed: refused, naming the field.
    jax.numpy.zeros(1).block_until_ready()
    assert len(jax.devices("cpu")) == 1
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args, "--set", "name=late"]) == 2
    err = capsys.readouterr().err
    assert "population.cpu_devices is 2, but JAX already started in this process" in err, err
    assert not (tmp_path / "runs" / "late").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"popmeta \S+\n", capsys.readouterr().out)


def test_missing_config_file_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nope.yaml"]) == 2
    assert "nope.yaml" in capsys.readouterr().err
