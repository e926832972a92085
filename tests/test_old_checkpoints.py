"""Runs written by an older popmeta resume bit for bit, and their checkpoints evaluate and export.

``tests/data/run_of_4267075`` was written by commit 4267075 (``popmeta train
today.yaml``, the run's second checkpoint dropped), the last popmeta whose
checkpoints were read and written as string-keyed dicts. (The run of 09c92bf,
from before the kinds were renamed, is tested in ``tests/test_kinds.py``.)
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import yaml

import popmeta as pm
from popmeta.actors.worker import exported_state_template
from popmeta.config import Config, config_from_dict
from popmeta.evaluate import load_theta
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.checkpoint_layout import RunCheckpoint, load_run_checkpoint
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from tests.population import tree_bytes

OLD_RUN = Path(__file__).resolve().parent / "data" / "run_of_4267075"
CHECKPOINT = OLD_RUN / "todayformat" / "checkpoints" / "ckpt_00000004.npz"


def _config(run_dir: Path) -> Config:
    """The old run's config (4 steps), trained on to step 6."""
    sections = yaml.safe_load((OLD_RUN / "today.yaml").read_text())
    train = {**sections["train"], "num_steps": 6}
    return config_from_dict({**sections, "run_dir": str(run_dir), "train": train})


def _final(config: Config) -> RunCheckpoint:
    path = list_checkpoints(Path(config.run_dir) / config.name / "checkpoints")[-1]
    learner = Learner.of(learner_start(config)).checkpoint_tree()
    return load_run_checkpoint(path, learner, exported_state_template(WorkerSpec.of(config)))


def test_a_run_of_4267075_resumes_bit_for_bit(tmp_path):
    shutil.copytree(OLD_RUN / "todayformat", tmp_path / "todayformat")
    stream = io.StringIO()
    resumed = pm.train(_config(tmp_path), stream=stream)
    assert "ckpt_00000004.npz at step 4" in stream.getvalue()
    assert "worker states restored: rank(s) [0, 1]" in stream.getvalue()
    assert resumed.final_step == 6

    straight = _config(tmp_path / "straight")
    pm.train(straight, stream=io.StringIO())
    a, b = _final(_config(tmp_path)), _final(straight)
    assert a.metadata.step == b.metadata.step == 6
    assert list(a.workers) == list(b.workers) == [0, 1]
    assert tree_bytes(a.learner) == tree_bytes(b.learner)
    assert tree_bytes(a.workers) == tree_bytes(b.workers)


def test_a_checkpoint_of_4267075_evaluates_and_exports(tmp_path):
    config, theta = load_theta(CHECKPOINT)
    assert config.learned_optimizer.kind == "learnable_adam" and config.name == "todayformat"
    with np.load(CHECKPOINT) as archive:  # theta as it lies on disk, under its old key
        assert np.array_equal(theta["log_lr"], archive["['theta']['log_lr']"])

    exported = pm.export_optimizer(CHECKPOINT, tmp_path / "optimizer.npz")
    trained = pm.read_trained_optimizer(exported)
    assert tree_bytes(trained.theta) == tree_bytes(theta)
    assert (trained.source["run"], trained.source["step"]) == ("todayformat", 4)
    direct = pm.read_trained_optimizer(CHECKPOINT)
    assert tree_bytes(direct.theta) == tree_bytes(theta)
