"""Tests for popmeta.config."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from popmeta.config import (
    Config,
    ConfigError,
    EstimatorConfig,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
)


def _write(tmp_path, text: str, name: str = "x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.name == "quickstart" and cfg.seed == 0 and cfg.run_dir == "runs"
    assert cfg.task.kind == "curved_quadratic" and cfg.task.options == {"dim": 10}
    assert cfg.learned_optimizer.kind == "mlp" and cfg.learned_optimizer.hidden_size == 32
    assert cfg.truncation.kind == "constant" and cfg.truncation.length == 100
    assert cfg.estimator.kind == "pes" and cfg.estimator.std == 0.01
    assert cfg.estimator.sign_delta_loss_scalar is None
    assert cfg.outer_optimizer.kind == "adam" and cfg.outer_optimizer.clip_grad_norm == 3.0
    assert cfg.population.resources == {} and cfg.population.engine == "ray"
    assert cfg.train.num_steps == 20000 and cfg.eval.seed == 1234
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]


def test_no_config_is_the_quickstart():
    """One source of defaults: the quickstart file spells out exactly the defaults."""
    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    assert load_config(quickstart) == load_config(None)


def test_digits_config_names_what_the_results_page_promises():
    """configs/digits_mlp.yaml: docs/results.md's specialist; a typo would fail only after 18 minutes."""
    digits = load_config(Path(__file__).resolve().parents[1] / "configs" / "digits_mlp.yaml")
    assert digits.name == "digits_mlp" and digits.task.kind == "image_mlp_digits"
    assert digits.learned_optimizer.kind == "mlp_adam"
    assert digits.estimator.meta_loss_split == "outer_valid"
    assert digits.eval.long_horizon_factors == (5,)
    assert {task.kind for task in digits.eval.out_of_distribution.values()} == {
        "image_mlp_digits16",
        "image_mlp_digits4",
    }


def test_yaml_file_loads(tmp_path):
    path = _write(
        tmp_path,
        """
name: run1
seed: 3
task:
  kind: image_mlp_npz
  npz_path: data/digits.npz
estimator:
  kind: nres
  std: 0.05
  num_tasks: 4
outer_optimizer:
  learning_rate: 1e-3   # YAML 1.1 reads this as a string
  clip_grad_norm: null
population:
  num_actors: 4
  mode: async
  resources: {TPU: 1}
train:
  num_steps: 10
""",
    )
    cfg = load_config(path)
    assert cfg.name == "run1" and cfg.seed == 3
    assert cfg.task.kind == "image_mlp_npz" and cfg.task.npz_path == "data/digits.npz"
    assert cfg.estimator == EstimatorConfig(kind="nres", options={"std": 0.05}, num_tasks=4)
    assert cfg.outer_optimizer.learning_rate == pytest.approx(1e-3)
    assert cfg.outer_optimizer.clip_grad_norm is None
    assert cfg.population.resources == {"TPU": 1.0}
    assert isinstance(cfg.population.resources["TPU"], float)
    assert cfg.population.mode == "async" and cfg.train.num_steps == 10
    # Untouched fields keep their defaults.
    assert cfg.truncation == Config().truncation


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()
    assert load_config(_write(tmp_path, "estimator:\n", "y.yaml")) == Config()


def test_overrides(tmp_path):
    path = _write(tmp_path, "task:\n  kind: image_mlp_npz\n  npz_path: a.npz\n")
    cfg = load_config(
        path,
        [
            "estimator.std=0.02",
            "train.num_steps=5",
            "task.kind=fixed_dim_quadratic",
            "task.npz_path=null",
            "population.pin_cpus=false",
            "outer_optimizer.learning_rate=3",
            "outer_optimizer.clip_grad_norm=null",
            "population.resources={TPU: 4, memory: 1.5}",
            "name=2024",
            "estimator={kind: nres, num_tasks: 2}",
        ],
    )
    assert cfg.estimator.std == 0.02
    assert cfg.train.num_steps == 5 and isinstance(cfg.train.num_steps, int)
    assert cfg.task.kind == "fixed_dim_quadratic" and cfg.task.options == {"dim": 10}
    assert cfg.population.pin_cpus is False
    assert cfg.outer_optimizer.learning_rate == 3.0
    assert isinstance(cfg.outer_optimizer.learning_rate, float)
    assert cfg.outer_optimizer.clip_grad_norm is None
    assert cfg.population.resources == {"TPU": 4.0, "memory": 1.5}
    assert cfg.name == "2024"
    # A section override merges into the section.
    assert cfg.estimator.kind == "nres" and cfg.estimator.num_tasks == 2
    assert cfg.estimator.std == 0.02
    # Later overrides win.
    assert load_config(None, ["seed=1", "seed=2"]).seed == 2


def test_an_override_repairs_a_bad_value_of_the_file_and_errors_name_their_source(tmp_path):
    path = _write(tmp_path, "task:\n  kind: curvd_quadratic\n  dim: 3\n")
    with pytest.raises(ConfigError, match=rf"got 'curvd_quadratic' \(in {path}\)"):
        load_config(path)
    assert load_config(path, ["task.kind=curved_quadratic"]).task.kind == "curved_quadratic"
    # A bad value from an override names the override; one left in the file, the file.
    with pytest.raises(
        ConfigError, match=r"task\.dim: expected int, got 'x' \(in --set task\.dim=x\)"
    ):
        load_config(path, ["task.kind=curved_quadratic", "task.dim=x"])
    with pytest.raises(ConfigError, match=rf"'curvd_quadratic' \(in {path}\)"):
        load_config(path, ["task.dim=4"])
    # A section override replaces what an earlier override set inside it.
    with pytest.raises(ConfigError, match=r"\(in --set task=\{dim: y, kind: quadratic\}\)"):
        load_config(path, ["task.dim=x", "task={dim: y, kind: quadratic}"])


def test_unknown_key_in_file_names_dotted_key_and_file(tmp_path):
    path = _write(tmp_path, "estimator:\n  stdd: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"unknown config key 'estimator.stdd' in {path}" in message
    # In a section that names a kind, the kind's fields are the known ones too.
    assert "not a field of estimator.kind='pes' (its fields: trunc_length, std," in message
    assert "the section's: num_tasks," in message
    assert "did you mean 'estimator.std'" in message

    with pytest.raises(ConfigError, match=r"unknown config key 'bogus'.*known keys: name, seed"):
        load_config(_write(tmp_path, "bogus: 1\n", "y.yaml"))


def test_unknown_key_in_override_names_dotted_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'estimator\.stdd' in --set"):
        load_config(None, ["estimator.stdd=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'nope'"):
        load_config(None, ["nope.x=1"])
    with pytest.raises(ConfigError, match=r"'seed\.x'.*not a section"):
        load_config(None, ["seed.x=1"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["estimator.std"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("estimator.std=abc", "estimator.std: expected float, got 'abc'"),
        ("train.num_steps=2.5", "train.num_steps: expected int, got 2.5"),
        ("train.num_steps=true", "train.num_steps: expected int, got True"),
        ("population.pin_cpus=1", "population.pin_cpus: expected bool, got 1"),
        ("estimator.clip_loss_diff=abc", "estimator.clip_loss_diff: expected float or null"),
        ("estimator.std=null", "estimator.std: expected float, got None"),
        ("population.resources=[1]", "population.resources: expected mapping of str to float"),
        ("population.resources={TPU: x}", "population.resources.TPU: expected float, got 'x'"),
        ("estimator.std=.nan", "estimator.std: expected a finite float"),
    ],
)
def test_wrong_type_names_field_and_expected(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)
    assert "--set" in str(info.value)


def test_wrong_type_in_file_names_file(tmp_path):
    path = _write(tmp_path, "estimator:\n  std: abc\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "estimator.std: expected float, got 'abc'" in str(info.value)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="estimator: expected a mapping"):
        load_config(_write(tmp_path, "estimator: 3\n", "y.yaml"))


def test_bad_literal_lists_choices():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["estimator.kind=pez"])
    message = str(info.value)
    assert "estimator.kind" in message and "'pez'" in message
    for choice in ("pes", "nres", "full_es", "truncated_es", "truncated_grad"):
        assert repr(choice) in message
    with pytest.raises(ConfigError, match=r"population\.mode: expected one of 'sync', 'async'"):
        config_from_dict({"population": {"mode": "on"}})
    with pytest.raises(ConfigError, match=r"outer_optimizer\.lr_decay: expected one of 'constant'"):
        load_config(None, ["outer_optimizer.lr_decay=step"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("estimator.std=0", "estimator.std: must be > 0"),
        ("estimator.std=-0.1", "estimator.std: must be > 0"),
        ("estimator.num_tasks=0", "estimator.num_tasks: must be > 0"),
        ("estimator.clip_loss_diff=-1", "estimator.clip_loss_diff: must be > 0"),
        ("estimator.random_initial_iteration_offset=-1", "random_initial_iteration_offset"),
        ("task.dim=0", "task.dim: must be > 0"),
        ("learned_optimizer.hidden_size=0", "learned_optimizer.hidden_size: must be > 0"),
        ("outer_optimizer.learning_rate=0", "outer_optimizer.learning_rate: must be > 0"),
        ("outer_optimizer.weight_decay=-1", "outer_optimizer.weight_decay: must be >= 0"),
        ("outer_optimizer.lr_decay_to=1.5", "outer_optimizer.lr_decay_to: must be in [0, 1]"),
        ("outer_optimizer.lr_decay_start=1", "outer_optimizer.lr_decay_start: must be in [0, 1)"),
        ("population.num_actors=0", "population.num_actors: must be > 0"),
        ("population.max_staleness=-1", "population.max_staleness: must be >= 0"),
        ("population.resources={TPU: -1}", "population.resources.TPU: must be >= 0"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints: must be > 0"),
        ("eval.num_steps=0", "eval.num_steps: must be > 0"),
        ("name=a/b", "name: must be a non-empty directory name"),
    ],
)
def test_range_errors_name_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            ["truncation.kind=log_uniform", "truncation.max_length=5"],
            "truncation.max_length: must be >= truncation.min_length (10), got 5",
        ),
        (
            ["learned_optimizer.kind=learnable_sgdm", "learned_optimizer.initial_momentum=1.0"],
            "learned_optimizer.initial_momentum: must be < 1",
        ),
    ],
)
def test_a_kinds_own_ranges_and_rules_name_its_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert field in str(info.value)


def test_compiled_graph_is_refused_outside_sync_mode():
    with pytest.raises(ConfigError, match=r"population\.compiled_graph: works in mode: sync only"):
        load_config(None, ["population.mode=async", "population.compiled_graph=true"])
    assert load_config(None, ["population.compiled_graph=true"]).population.compiled_graph


def test_cpu_devices_must_split_the_tasks_evenly_and_agree_with_xla_flags():
    ok = load_config(None, ["estimator.num_tasks=6", "population.cpu_devices=3"])
    assert ok.population.cpu_devices == 3 and load_config(None).population.cpu_devices is None
    with pytest.raises(
        ConfigError,
        match=r"population\.cpu_devices: .*estimator\.num_tasks \(6\) must be a multiple of "
        r"cpu_devices \(4\)",
    ):
        load_config(None, ["estimator.num_tasks=6", "population.cpu_devices=4"])
    with pytest.raises(ConfigError, match=r"population\.cpu_devices: must be a number of devices"):
        load_config(None, ["population.cpu_devices=0"])
    with pytest.raises(ConfigError, match=r"population\.cpu_devices: .*shard_tasks: false forbids"):
        load_config(None, ["population.cpu_devices=2", "population.shard_tasks=false"])
    flags = "{XLA_FLAGS: --xla_force_host_platform_device_count=4}"
    with pytest.raises(
        ConfigError,
        match=r"population\.env: XLA_FLAGS sets --xla_force_host_platform_device_count=4, and "
        r"population\.cpu_devices is 2",
    ):
        load_config(None, ["population.cpu_devices=2", f"population.env={flags}"])


def test_range_checks_apply_to_direct_construction():
    with pytest.raises(ConfigError, match=r"estimator\.std: must be > 0"):
        Config(estimator=EstimatorConfig(options={"std": 0.0}))
    with pytest.raises(ConfigError, match=r"train\.num_steps"):
        dataclasses.replace(Config(), train=dataclasses.replace(Config().train, num_steps=0))


def test_npz_family_requires_npz_path(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.npz_path: kind 'image_mlp_npz' needs it"):
        load_config(None, ["task.kind=image_mlp_npz"])
    path = _write(tmp_path, "task:\n  kind: image_mlp_npz\n")
    with pytest.raises(ConfigError, match=rf"task\.npz_path.*{re.escape(path.name)}"):
        load_config(path)
    assert load_config(path, ["task.npz_path=d.npz"]).task.npz_path == "d.npz"


def test_round_trip_dict_config_dict(tmp_path):
    cfg = load_config(
        None, ["population.resources={TPU: 2}", "estimator.clip_loss_diff=0.5", "name=r"]
    )
    d = config_to_dict(cfg)
    assert isinstance(d["estimator"], dict)
    assert config_from_dict(d) == cfg
    # Through YAML and JSON text as well (checkpoints store it as JSON).
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert config_from_dict(json.loads(json.dumps(d))) == cfg
    assert config_to_dict(config_from_dict(d)) == d
    path = _write(tmp_path, config_to_yaml(cfg), "resolved.yaml")
    assert load_config(path) == cfg


def test_unreadable_or_non_mapping_yaml_names_file(tmp_path):
    path = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*mapping.*list"):
        load_config(path)
    path = _write(tmp_path, "3\n", "scalar.yaml")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*mapping"):
        load_config(path)
    path = _write(tmp_path, "a: [1, 2\n", "broken.yaml")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*not valid YAML"):
        load_config(path)
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=rf"cannot read config file {re.escape(str(missing))}"):
        load_config(missing)
    with pytest.raises(ConfigError, match=rf"cannot read config file {re.escape(str(tmp_path))}"):
        load_config(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(binary))}"):
        load_config(binary)
    with pytest.raises(ConfigError, match="config: expected a mapping"):
        config_from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (
            ["estimator.kind=full_es", "truncation.kind=log_uniform"],
            ["estimator.kind", "truncation.kind: constant", "'log_uniform'"],
        ),
        (["estimator.kind=truncated_grad", "estimator.clip_loss_diff=1"], ["clip_loss_diff"]),
        (["task.npz_path=x.npz"], ["task.npz_path", "not a field of task.kind='curved_quadratic'"]),
        (["population.engine=local", "population.mode=async"], ["population.mode", "local"]),
        (["population.engine=local", "population.address=auto"], ["population.address"]),
        (["population.engine=local", "population.batch_size=4"], ["population.batch_size"]),
        (["population.engine=local", "population.max_staleness=0"], ["max_staleness"]),
        (["population.engine=local", "population.env={A: b}"], ["population.env"]),
        (
            ["population.one_actor_per_node_with=TPU", "population.num_actors=4"],
            ["population.num_actors", "'TPU'"],
        ),
    ],
)
def test_cross_field_rules_fail_before_anything_starts(overrides, fields):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for field in fields:
        assert field in str(info.value)


def test_cross_field_rules_let_valid_combinations_through():
    local = load_config(None, ["population.engine=local", "population.num_actors=3"])
    assert local.population.num_actors == 3 and local.population.shard_tasks
    full_es = load_config(None, ["estimator.kind=full_es", "truncation.kind=constant"])
    assert full_es.estimator.kind == "full_es"
    per_node = load_config(None, ["population.one_actor_per_node_with=TPU"])
    assert per_node.population.one_actor_per_node_with == "TPU"
    npz = load_config(None, ["task.kind=image_mlp_npz", "task.npz_path=x.npz"])
    assert npz.task.npz_path == "x.npz"
