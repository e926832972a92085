"""The generalist's parts in a config and a run: rescaled training families, normalized updates."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest

from popmeta.config import ConfigError, config_from_dict
from popmeta.core.learned_optimizers import NormalizedMLPLOpt
from popmeta.core.mixture_truncated_step import MixtureTruncatedStep
from popmeta.core.tasks import RescaledFamily, ScaleRange
from popmeta.evaluate import settings_of
from popmeta.experiment import (
    EstimatorSections,
    build_learned_optimizer,
    build_task_family,
    build_truncated_step,
    learner_start,
)
from popmeta.learner.checkpoint_layout import load_run_checkpoint
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.run_loop import train
from tests.local_run import local_config
from tests.population import tree_bytes


def _mixture_config() -> dict:
    return {
        "task": {
            "kind": "image_mlp_digits",
            "rescale_per_tensor": [0.1, 10],
            "rescale_overall": [0.5, 2],
            "mixture": {
                "image_mlp_digits": 1,
                "parametric_image_mlp_digits": {"weight": 1, "groups": 2},
                "image_mlp_digits4": {"weight": 1, "rescale_per_tensor": [1, 1]},
            },
        },
        "estimator": {"kind": "pes", "num_tasks": 6, "meta_loss_split": "outer_valid"},
        "learned_optimizer": {"kind": "normalized_mlp"},
    }


def test_rescaling_wraps_the_training_families_and_meta_testing_runs_the_plain_one():
    config = config_from_dict(_mixture_config())
    step = build_truncated_step(EstimatorSections.of(config))
    assert isinstance(step, MixtureTruncatedStep)
    families = [group.task_family for group in step.groups]
    assert len(families) == 4  # digits, two parametric architectures, digits4
    for family in families[:3]:
        assert isinstance(family, RescaledFamily)
        assert family.per_tensor == ScaleRange(0.1, 10.0)
        assert family.overall == ScaleRange(0.5, 2.0)
    # A member's own range wins over the section's: [1, 1] per tensor, the section's overall.
    assert isinstance(families[3], RescaledFamily)
    assert families[3].per_tensor == ScaleRange(1.0, 1.0)
    assert families[3].overall == ScaleRange(0.5, 2.0)
    tested = build_task_family(settings_of(config)[0].task)
    assert not isinstance(tested, RescaledFamily)
    assert isinstance(build_learned_optimizer(config.learned_optimizer), NormalizedMLPLOpt)


def test_bad_ranges_and_rescaled_meta_testing_are_refused_naming_the_field():
    raw = _mixture_config()
    raw["task"]["rescale_overall"] = [2, 0.5]
    with pytest.raises(ConfigError, match=r"task\.rescale_overall: expected \[low, high\]"):
        config_from_dict(raw)
    raw = _mixture_config()
    raw["task"]["mixture"]["image_mlp_digits4"]["rescale_per_tensor"] = [0, 1]
    with pytest.raises(ConfigError, match=r"task\.mixture\.image_mlp_digits4\.rescale_per_tensor"):
        config_from_dict(raw)
    raw = _mixture_config()
    raw["eval"] = {
        "out_of_distribution": {"big": {"kind": "conv_digits", "rescale_overall": [1, 3]}}
    }
    with pytest.raises(ConfigError, match=r"out_of_distribution\.big\.rescale_per_tensor"):
        config_from_dict(raw)


def _generalist_like(run_dir: Path, name: str, num_steps: int):
    return local_config(
        run_dir,
        name,
        task={"kind": "curved_quadratic", "dim": 4, "rescale_per_tensor": [0.1, 10]},
        learned_optimizer={"kind": "normalized_mlp", "initial_lr": 0.01, "hidden_size": 8},
        truncation={"kind": "log_uniform", "min_length": 4, "max_length": 16},
        estimator={"kind": "pes", "num_tasks": 3, "trunc_length": 4},
        train={"num_steps": num_steps, "checkpoint_every": 2},
    )


def _final_checkpoint(config):
    path = list_checkpoints(Path(config.run_dir) / config.name / "checkpoints")[-1]
    return load_run_checkpoint(path, Learner.of(learner_start(config)).checkpoint_tree())


def test_a_rescaled_log_uniform_run_of_the_normalized_optimizer_continues_bit_for_bit(tmp_path):
    straight = _generalist_like(tmp_path, "straight", 6)
    train(straight, stream=io.StringIO())
    extended = _generalist_like(tmp_path, "extended", 2)
    train(extended, stream=io.StringIO())
    out = io.StringIO()
    train(dataclasses.replace(extended, train=straight.train), stream=out)
    assert "resumed from" in out.getvalue()
    a, b = _final_checkpoint(straight), _final_checkpoint(extended)
    assert a.metadata.step == b.metadata.step == 6
    assert tree_bytes(a.learner.theta) == tree_bytes(b.learner.theta)
    assert np.all(np.isfinite(np.asarray(a.learner.theta["log_lr"])))
