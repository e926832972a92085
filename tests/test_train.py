"""The run loop's ownership of what it opens: the last checkpoint comes before any shutdown step."""

from __future__ import annotations

import io

import pytest

import popmeta
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint, read_run_metadata
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.population.engines import open_population
from popmeta.population.local import LocalPopulation
from popmeta.run_loop import train
from tests.events import read_scalars
from tests.local_run import local_config
from tests.population import tree_bytes


def _config(run_dir):
    return local_config(
        run_dir,
        name="owner",
        population={"num_actors": 2},
        train={"num_steps": 6, "checkpoint_every": 1000},
    )


class PopulationThatFailsToClose(LocalPopulation):
    """A real in-process population whose shutdown fails, as a lost cluster's can."""

    def close(self) -> None:
        super().close()
        raise RuntimeError("the population could not be closed")


def test_a_failing_shutdown_keeps_the_final_checkpoint_and_the_events(tmp_path):
    config = _config(tmp_path)
    with pytest.raises(RuntimeError, match="could not be closed"):
        train(config, PopulationThatFailsToClose, stream=io.StringIO())
    run_dir = tmp_path / "owner"
    # checkpoint_every is far away: this is the final checkpoint, written first.
    (checkpoint,) = list_checkpoints(run_dir / "checkpoints")
    assert checkpoint.name == "ckpt_00000006.npz"
    # Written while the population was still up: both workers' states are in it.
    assert read_run_metadata(checkpoint).worker_ranks == (0, 1)
    assert [step for step, _ in read_scalars(run_dir)["meta_loss"]] == [2, 4, 6]


def test_the_local_engine_needs_no_ray_and_reports_its_workers(tmp_path):
    config = _config(tmp_path)
    with open_population(config.population, WorkerSpec.of(config)) as population:
        assert isinstance(population, LocalPopulation)
        actors = population.describe_actors()
        assert [a.rank for a in actors] == [0, 1]
        assert {a.node_id for a in actors} == {"local"}
    assert population.workers == []  # closed on exit
    stream = io.StringIO()
    result = train(config, stream=stream)
    assert result.final_step == 6 and not result.interrupted
    assert "2 worker(s) in this process, one after another (local engine)" in stream.getvalue()
    # No actors, so no staleness, drops, losses or restarts to report.
    tags = set(read_scalars(tmp_path / "owner"))
    assert {"meta_loss", "estimates_per_s", "rejected_nonfinite"} <= tags
    for tag in ("actor_restarts", "live_actors", "staleness_max", "lost_in_flight"):
        assert tag not in tags, tag


def test_popmeta_train_from_python_returns_theta_and_the_newest_checkpoint(tmp_path):
    config = _config(tmp_path)
    result = popmeta.train(config, stream=io.StringIO())
    assert isinstance(result, popmeta.RunResult) and result.final_step == 6
    assert result.checkpoint == tmp_path / "owner" / "checkpoints" / "ckpt_00000006.npz"
    saved = load_run_checkpoint(
        result.checkpoint, Learner.of(learner_start(config)).checkpoint_tree()
    )
    assert tree_bytes(result.theta) == tree_bytes(saved.learner.theta)
    # A second call finds the run finished: the same theta, nothing trained.
    again = popmeta.train(config, stream=io.StringIO())
    assert again.already_finished and tree_bytes(again.theta) == tree_bytes(result.theta)
