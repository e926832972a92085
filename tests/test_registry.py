"""One registry per kind: the config accepts, the builders build and the docs list the same names."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from popmeta.cli import main
from popmeta.config import (
    Config,
    ConfigError,
    EstimatorConfig,
    LearnedOptimizerConfig,
    OuterOptimizerConfig,
    TaskConfig,
    TruncationConfig,
    config_from_dict,
)
from popmeta.core.estimators import GradientEstimator
from popmeta.core.learned_optimizers import LearnedOptimizer
from popmeta.core.tasks import TaskFamily
from popmeta.core.truncation import TruncationSchedule
from popmeta.experiment import (
    build_estimator,
    build_learned_optimizer,
    build_task_family,
    build_truncation_schedule,
)
from popmeta.learner.train_state import make_outer_optimizer
from popmeta.registry import (
    DATA_FREE_TASK_FAMILIES,
    ESTIMATORS,
    LEARNED_OPTIMIZERS,
    OUTER_OPTIMIZERS,
    REGISTRIES,
    TASK_FAMILIES,
    TRUNCATION_SCHEDULES,
    Registry,
    render_markdown,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "kinds.md"

#: (registry, config section class, field) for every kind field of the config.
KIND_FIELDS = [
    (TASK_FAMILIES, TaskConfig, "family"),
    (LEARNED_OPTIMIZERS, LearnedOptimizerConfig, "kind"),
    (TRUNCATION_SCHEDULES, TruncationConfig, "schedule"),
    (ESTIMATORS, EstimatorConfig, "kind"),
    (OUTER_OPTIMIZERS, OuterOptimizerConfig, "name"),
]


@pytest.mark.parametrize(("registry", "section", "field"), KIND_FIELDS)
def test_config_accepts_exactly_the_registered_names(registry, section, field):
    accepted = typing.get_args(typing.get_type_hints(section)[field])
    assert accepted == registry.names and len(accepted) >= 3
    section_name = registry.field.split(".")[0]
    assert registry.field == f"{section_name}.{field}"
    for name in registry.names:
        config_from_dict({section_name: {field: name}} | _needs(section_name, name))
    with pytest.raises(ConfigError, match=rf"{registry.field}: expected one of .*'nope'"):
        config_from_dict({section_name: {field: "nope"}})


def _needs(section: str, name: str) -> dict:
    """Other fields a kind requires, so that each name alone forms a valid config."""
    if (section, name) == ("task", "image_mlp_npz"):
        return {"task": {"family": name, "npz_path": "digits.npz"}}
    return {}


def test_every_registry_is_covered_and_documented():
    assert {id(r) for r, _, _ in KIND_FIELDS} == {id(r) for r in REGISTRIES}
    assert DOCS.read_text() == render_markdown(), "regenerate with: popmeta kinds > docs/kinds.md"
    for registry in REGISTRIES:
        for entry in registry:
            assert f"| `{entry.name}` | {entry.summary} |" in DOCS.read_text()


def test_popmeta_kinds_prints_the_docs(capsys):
    assert main(["kinds"]) == 0
    assert capsys.readouterr().out == DOCS.read_text()


def _npz(tmp_path) -> str:
    rng = np.random.default_rng(0)
    path = tmp_path / "digits.npz"
    np.savez(path, images=rng.random((64, 8, 8)), labels=rng.integers(0, 10, 64))
    return str(path)


def test_every_task_family_builds_and_samples_a_task(tmp_path):
    for name in TASK_FAMILIES.names:
        npz_path = _npz(tmp_path) if name == "image_mlp_npz" else None
        family = build_task_family(TaskConfig(family=name, dim=3, npz_path=npz_path))
        assert isinstance(family, TaskFamily), name
        task = family.task_fn(family.sample(jax.random.key(0)))
        params = task.init(jax.random.key(1))
        assert jax.tree_util.tree_leaves(params), name


def test_data_free_families_are_exactly_those_without_data(tmp_path):
    npz_path = _npz(tmp_path)
    for name in TASK_FAMILIES.names:
        family = build_task_family(
            TaskConfig(family=name, dim=3, npz_path=npz_path if name == "image_mlp_npz" else None)
        )
        assert (family.datasets is None) == (name in DATA_FREE_TASK_FAMILIES), name


def test_every_learned_optimizer_and_schedule_builds():
    for name in LEARNED_OPTIMIZERS.names:
        lopt = build_learned_optimizer(LearnedOptimizerConfig(kind=name))
        assert isinstance(lopt, LearnedOptimizer), name
        assert jax.tree_util.tree_leaves(lopt.init(jax.random.key(0))), name
    for name in TRUNCATION_SCHEDULES.names:
        schedule = build_truncation_schedule(TruncationConfig(schedule=name))
        assert isinstance(schedule, TruncationSchedule), name


def test_every_estimator_builds_on_the_configured_step():
    for name in ESTIMATORS.names:
        config = Config(
            task=TaskConfig(family="fixed_dim_quadratic", dim=3),
            learned_optimizer=LearnedOptimizerConfig(kind="learnable_sgd"),
            truncation=TruncationConfig(length=12),
            estimator=EstimatorConfig(kind=name, num_tasks=2, trunc_length=4),
        )
        estimator = build_estimator(config)
        assert isinstance(estimator, GradientEstimator), name
        assert estimator.truncated_step.num_tasks == 2
        # FullES unrolls whole episodes; the others one truncation.
        assert estimator.trunc_length == (12 if name == "full_es" else 4), name


def test_every_outer_optimizer_keeps_the_chain_layout():
    params = {"w": np.ones(3, np.float32)}
    for name in OUTER_OPTIMIZERS.names:
        for clip in (None, 1.0):
            tx = make_outer_optimizer(name, 0.1, clip_grad_norm=clip, weight_decay=0.01)
            state = tx.init(params)
            # One chain: [clip,] [L2 decay,] optimizer: never a nested chain.
            expected = (clip is not None) + (name != "adamw") + 1
            assert isinstance(state, tuple) and len(state) == expected, (name, clip)
            updates, _ = tx.update({"w": np.ones(3, np.float32)}, state, params)
            assert np.all(np.asarray(optax.apply_updates(params, updates)["w"]) < 1.0), name


def test_unknown_names_fail_naming_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"estimator\.kind: expected one of 'pes'.*got 'pez'"):
        ESTIMATORS.build("pez")
    with pytest.raises(ValueError, match="expected one of"):
        build_task_family(dataclasses.replace(TaskConfig(), family="nope"))


def test_a_name_registers_once():
    registry: Registry[int] = Registry("x.kind", "Xs", "nothing")
    registry.register("a", "first")(lambda: 1)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a", "again")(lambda: 2)
    assert registry.build("a") == 1 and registry.names == ("a",) and "a" in registry
