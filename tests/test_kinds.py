"""Every section names its kind with ``kind``; user kinds by import path or by decorator.

The old field names fail naming the new ones, while what popmeta recorded
itself (a run directory and a checkpoint written before the change, kept in
``tests/data/run_of_09c92bf``) still loads and resumes bit for bit.
"""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

import popmeta as pm
from popmeta.config import ConfigError, config_from_dict, config_to_dict, load_config
from popmeta.evaluate import load_theta
from popmeta.experiment import build_outer_optimizer, build_task_family, learner_start
from popmeta.learner.checkpoint_layout import load_run_checkpoint
from popmeta.learner.checkpoints import list_checkpoints
from popmeta.learner.learner import Learner
from popmeta.registry import TASK_FAMILIES
from tests.population import tree_bytes
from tests.user_kinds import USER_KINDS

OLD_RUN = Path(__file__).resolve().parent / "data" / "run_of_09c92bf"


@pytest.mark.parametrize(
    ("section", "old", "new"),
    [
        ({"task": {"family": "quadratic"}}, "task.family", "task.kind"),
        ({"task": {"families": {"quadratic": 1}}}, "task.families", "task.mixture"),
        ({"task": {"parametric_groups": 2}}, "task.parametric_groups", "task.groups"),
        ({"truncation": {"schedule": "constant"}}, "truncation.schedule", "truncation.kind"),
        ({"outer_optimizer": {"name": "sgd"}}, "outer_optimizer.name", "outer_optimizer.kind"),
        (
            {"eval": {"out_of_distribution": {"x": {"family": "quadratic"}}}},
            "eval.out_of_distribution.x.family",
            "eval.out_of_distribution.x.kind",
        ),
        (
            {"eval": {"long_horizon_factor": 5}},
            "eval.long_horizon_factor",
            "eval.long_horizon_factors",
        ),
    ],
)
def test_an_old_field_name_fails_naming_the_new_one(section, old, new):
    with pytest.raises(ConfigError, match=rf"{old} was renamed: it is {new}"):
        config_from_dict(section)


def test_a_recorded_config_of_the_old_names_reads_as_the_same_experiment():
    recorded = yaml.safe_load((OLD_RUN / "oldformat" / "config.yaml").read_text())
    config = config_from_dict(recorded, recorded=True)
    assert config.task.kind == "fixed_dim_quadratic" and config.task.options == {"dim": 3}
    # learnable_adam's first-moment decay was stored as initial_momentum.
    assert config.learned_optimizer.options == {"initial_lr": 0.01, "initial_beta1": 0.8}
    assert config.truncation.kind == "constant" and config.truncation.options == {"length": 10}
    assert config.outer_optimizer.kind == "adam" and config.outer_optimizer.learning_rate == 0.01
    assert config.eval.out_of_distribution["other"].options == {"dim": 2}
    assert config.eval.long_horizon_factors == (5,)
    # The same experiment written in today's names is the same config.
    assert config == config_from_dict(config_to_dict(config))
    with pytest.raises(ConfigError, match=r"task\.family was renamed"):
        config_from_dict(recorded)  # what a user writes must use the new names


def test_an_old_run_resumes_bit_for_bit_and_its_checkpoint_evaluates(tmp_path):
    shutil.copytree(OLD_RUN / "oldformat", tmp_path / "oldformat")
    today = {
        "name": "oldformat",
        "run_dir": str(tmp_path),
        "task": {"kind": "fixed_dim_quadratic", "dim": 3},
        "learned_optimizer": {"kind": "learnable_adam", "initial_lr": 0.01, "initial_beta1": 0.8},
        "truncation": {"kind": "constant", "length": 10},
        "estimator": {"kind": "pes", "trunc_length": 5, "num_tasks": 2},
        "outer_optimizer": {"kind": "adam", "learning_rate": 0.01},
        "population": {"engine": "local"},
        "train": {"num_steps": 6, "checkpoint_every": 2},
        "eval": {
            "num_tasks": 2,
            "num_steps": 5,
            "after_training": False,
            "out_of_distribution": {"other": {"kind": "quadratic", "dim": 2}},
        },
    }
    today["estimator"]["random_initial_iteration_offset"] = 10
    stream = io.StringIO()
    resumed = pm.train(config_from_dict(today), stream=stream)
    assert "ckpt_00000004.npz at step 4" in stream.getvalue()
    assert "worker states restored: rank(s) [0, 1]" in stream.getvalue()

    straight = config_from_dict({**today, "run_dir": str(tmp_path / "straight")})
    pm.train(straight, stream=io.StringIO())
    target = Learner.of(learner_start(straight)).checkpoint_tree()
    ends = [
        load_run_checkpoint(list_checkpoints(root / "oldformat" / "checkpoints")[-1], target)
        for root in (tmp_path, tmp_path / "straight")
    ]
    assert resumed.final_step == 6 and tree_bytes(ends[0].learner) == tree_bytes(ends[1].learner)
    config, theta = load_theta(OLD_RUN / "oldformat" / "checkpoints" / "ckpt_00000004.npz")
    assert config.learned_optimizer.kind == "learnable_adam" and set(theta) >= {"log_lr"}


def test_optax_aliases_are_outer_optimizers_by_import_path():
    config = load_config(
        None, ["outer_optimizer.kind=optax:adamw", "outer_optimizer.learning_rate=0.003"]
    )
    assert config.outer_optimizer.options["learning_rate"] == 0.003
    assert config.outer_optimizer.options["weight_decay"] == 1e-4  # optax's default
    (adamw,) = build_outer_optimizer(config.outer_optimizer)
    params = {"w": jnp.ones(2)}
    updates, _ = adamw.update(params, adamw.init(params), params)
    assert float(updates["w"][0]) < 0
    # A required parameter without a default must be given.
    with pytest.raises(
        ConfigError, match=r"outer_optimizer\.learning_rate: kind 'optax:sgd' needs"
    ):
        load_config(None, ["outer_optimizer.kind=optax:sgd"])


def _module(tmp_path: Path, name: str, source: str) -> Path:
    (tmp_path / f"{name}.py").write_text(source)
    return tmp_path


def test_a_user_kind_by_import_path_is_checked_like_a_built_in_one(tmp_path):
    config_file = _module(tmp_path, "user_tasks", USER_KINDS) / "run.yaml"
    config_file.write_text("task: {kind: 'user_tasks:noisy_targets', dim: 3, noise: 0.2}\n")
    # Found beside the config file, though not importable as it is.
    config = load_config(config_file)
    assert config.task.options == {"dim": 3, "noise": 0.2}
    assert config.found_modules() == [str(tmp_path / "user_tasks.py")]
    assert build_task_family(config.task).dim == 3
    bad = {
        "task.nois": "not a field of task.kind='user_tasks:noisy_targets' (its fields: dim, noise",
        "task.dim": "task.dim: expected int, got 'x'",
    }
    for field, message in bad.items():
        value = "x" if field == "task.dim" else "1"
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(config_file, [f"{field}={value}"])
    errors = {
        "no_such_module:f": "cannot import module 'no_such_module'",
        "user_tasks:nope": "module 'user_tasks' has no attribute 'nope'",
        "user_tasks:jax": "'user_tasks:jax' is a module, not a callable",
    }
    for kind, message in errors.items():
        with pytest.raises(ConfigError, match=rf"task\.kind: .*{re.escape(message)}"):
            load_config(config_file, [f"task.kind={kind}", "task.dim=null", "task.noise=null"])
    wrong = load_config(config_file, ["task.kind=user_tasks:not_a_family", "task.noise=null"])
    with pytest.raises(ConfigError, match=r"task\.kind: 'user_tasks:not_a_family' returned a int"):
        build_task_family(wrong.task)


def test_a_kind_registered_in_python_trains_without_a_module_file(tmp_path):
    @pm.register_task_family
    def shifted_quadratic(dim: int = 2, shift: float = 1.0) -> pm.TaskFamily:
        """A quadratic whose optimum sits at ``shift``."""
        return _Shifted(dim, shift)

    try:
        config = config_from_dict(
            {
                "name": "registered",
                "run_dir": str(tmp_path),
                "task": {"kind": "shifted_quadratic", "shift": 2.0},
                "learned_optimizer": {"kind": "learnable_sgd"},
                "truncation": {"length": 10},
                "estimator": {
                    "num_tasks": 2,
                    "trunc_length": 5,
                    "random_initial_iteration_offset": 10,
                },
                "population": {"engine": "local"},
                "train": {"num_steps": 2, "checkpoint_every": 2},
                "eval": {"num_tasks": 2, "num_steps": 5, "after_training": False},
            }
        )
        result = pm.train(config, stream=io.StringIO())
        assert result.final_step == 2 and result.checkpoint is not None
        assert "shifted_quadratic" in TASK_FAMILIES  # listed among the names, not in the docs
        assert all(kind.name != "shifted_quadratic" for kind in TASK_FAMILIES)
    finally:
        TASK_FAMILIES._kinds.pop("shifted_quadratic", None)
        TASK_FAMILIES._by_users.discard("shifted_quadratic")


class _ShiftedTask(pm.Task):
    def __init__(self, dim, shift):
        self.dim, self.shift = dim, shift

    def init(self, key):
        return jax.random.normal(key, (self.dim,))

    def loss(self, params, key, data):
        return jnp.sum(jnp.square(params - self.shift))


class _Shifted(pm.TaskFamily):
    def __init__(self, dim, shift):
        self.task = _ShiftedTask(dim, shift)

    def sample(self, key):
        return jnp.zeros(())

    def task_fn(self, task_params):
        return self.task


def test_the_driver_imports_user_modules_from_the_runtime_env_it_ships(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "shipped_kinds.py").write_text(USER_KINDS)
    config = tmp_path / "configs" / "run.yaml"
    config.parent.mkdir()
    config.write_text(
        "task: {kind: 'shipped_kinds:noisy_targets'}\n"
        f"population: {{runtime_env: {{py_modules: ['{code / 'shipped_kinds.py'}']}}}}\n"
    )
    loaded = load_config(config)  # not beside the config: found through py_modules
    assert loaded.task.options == {"dim": 4, "noise": 0.1}
    assert loaded.population.runtime_env == {"py_modules": [str(code / "shipped_kinds.py")]}
