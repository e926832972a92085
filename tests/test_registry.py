"""One registry per kind: the config accepts, the builders build and the docs list the same names."""

from __future__ import annotations

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
    EstimatorSections,
    build_estimator,
    build_learned_optimizer,
    build_task_family,
    build_truncation_schedule,
)
from popmeta.learner.train_state import make_outer_optimizer
from popmeta.registry import (
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

#: (registry, config section class) for every section that names a kind.
KIND_SECTIONS = [
    (TASK_FAMILIES, TaskConfig),
    (LEARNED_OPTIMIZERS, LearnedOptimizerConfig),
    (TRUNCATION_SCHEDULES, TruncationConfig),
    (ESTIMATORS, EstimatorConfig),
    (OUTER_OPTIMIZERS, OuterOptimizerConfig),
]


def _needs(section: str, name: str) -> dict:
    """Fields a kind requires, so that each name alone forms a valid section."""
    if (section, name) == ("task", "image_mlp_npz"):
        return {"npz_path": "digits.npz"}
    return {}


@pytest.mark.parametrize(("registry", "section"), KIND_SECTIONS)
def test_every_section_names_its_kind_with_kind_and_takes_exactly_the_registered_names(
    registry, section
):
    assert section.REGISTRY is registry and registry.field == f"{registry.section}.kind"
    assert len(registry.names) >= 3
    for name in registry.names:
        config = config_from_dict(
            {registry.section: {"kind": name, **_needs(registry.section, name)}}
        )
        assert getattr(config, registry.section).kind == name
    with pytest.raises(ConfigError, match=rf"{registry.field}: expected one of .*got 'nope'"):
        config_from_dict({registry.section: {"kind": "nope"}})


def test_the_schema_names_no_kind():
    config = Path(__file__).resolve().parents[1] / "popmeta" / "config"
    schema = "".join(
        (config / name).read_text() for name in ("schema.py", "kind_sections.py", "sections.py")
    )
    for registry in REGISTRIES:
        for name in registry.names:
            default = {"curved_quadratic", "mlp", "constant", "pes", "adam"}
            if name not in default:  # the sections' defaults are the quickstart's kinds
                assert f'"{name}"' not in schema and f"'{name}'" not in schema, name


def test_every_registry_is_covered_and_documented_with_each_kinds_fields():
    assert {id(r) for r, _ in KIND_SECTIONS} == {id(r) for r in REGISTRIES}
    assert DOCS.read_text() == render_markdown(), "regenerate with: popmeta kinds > docs/kinds.md"
    for registry in REGISTRIES:
        for kind in registry:
            assert f"| `{kind.name}` | {kind.summary} |" in DOCS.read_text()
            for field in kind.fields:
                assert f"`{field.signature()}`" in DOCS.read_text(), (kind.name, field.name)


def test_popmeta_kinds_prints_the_docs(capsys):
    assert main(["kinds"]) == 0
    assert capsys.readouterr().out == DOCS.read_text()


def _npz(tmp_path) -> str:
    rng = np.random.default_rng(0)
    path = tmp_path / "digits.npz"
    np.savez(path, images=rng.random((64, 8, 8)), labels=rng.integers(0, 10, 64))
    return str(path)


def _task(name: str, tmp_path) -> TaskConfig:
    kind = TASK_FAMILIES.resolve(name)
    options = {"dim": 3} if kind.field("dim") else {}
    if name == "image_mlp_npz":
        options["npz_path"] = _npz(tmp_path)
    return TaskConfig(kind=name, options=options)


def test_every_task_family_builds_and_samples_a_task(tmp_path):
    for name in TASK_FAMILIES.names:
        family = build_task_family(_task(name, tmp_path))
        assert isinstance(family, TaskFamily), name
        task = family.task_fn(family.sample(jax.random.key(0)))
        params = task.init(jax.random.key(1))
        assert jax.tree_util.tree_leaves(params), name


def test_data_free_families_are_exactly_those_without_data(tmp_path):
    for name in TASK_FAMILIES.names:
        family = build_task_family(_task(name, tmp_path))
        data_free = TASK_FAMILIES.resolve(name).traits.get("data_free", False)
        assert (family.datasets is None) == data_free, name


def test_every_learned_optimizer_and_schedule_builds():
    for name in LEARNED_OPTIMIZERS.names:
        lopt = build_learned_optimizer(LearnedOptimizerConfig(kind=name))
        assert isinstance(lopt, LearnedOptimizer), name
        assert jax.tree_util.tree_leaves(lopt.init(jax.random.key(0))), name
    for name in TRUNCATION_SCHEDULES.names:
        schedule = build_truncation_schedule(TruncationConfig(kind=name))
        assert isinstance(schedule, TruncationSchedule), name


def test_every_estimator_builds_on_the_configured_step():
    for name in ESTIMATORS.names:
        options = {} if name == "full_es" else {"trunc_length": 4}
        config = Config(
            task=TaskConfig(kind="fixed_dim_quadratic", options={"dim": 3}),
            learned_optimizer=LearnedOptimizerConfig(kind="learnable_sgd"),
            truncation=TruncationConfig(options={"length": 12}),
            estimator=EstimatorConfig(kind=name, options=options, num_tasks=2),
        )
        estimator = build_estimator(EstimatorSections.of(config))
        assert isinstance(estimator, GradientEstimator), name
        assert estimator.truncated_step.num_tasks == 2
        # FullES unrolls whole episodes; the others one truncation.
        assert estimator.trunc_length == (12 if name == "full_es" else 4), name


def test_every_outer_optimizer_keeps_the_chain_layout():
    params = {"w": np.ones(3, np.float32)}
    for name in OUTER_OPTIMIZERS.names:
        for clip in (None, 1.0):
            tx = make_outer_optimizer(name, clip, learning_rate=0.1, weight_decay=0.01)
            state = tx.init(params)
            # One chain: [clip,] [L2 decay,] optimizer: never a nested chain.
            expected = (clip is not None) + (name != "adamw") + 1
            assert isinstance(state, tuple) and len(state) == expected, (name, clip)
            updates, _ = tx.update({"w": np.ones(3, np.float32)}, state, params)
            assert np.all(np.asarray(optax.apply_updates(params, updates)["w"]) < 1.0), name


def test_unknown_names_fail_naming_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"estimator\.kind: expected one of 'pes'.*got 'pez'"):
        ESTIMATORS.resolve("pez")
    with pytest.raises(ConfigError, match="expected one of"):
        build_task_family(TaskConfig(kind="nope"))


def test_a_field_of_a_number_or_a_word_takes_either_and_names_the_field_otherwise():
    """``fan_in_power: float >= 0 | 'learned'``: the range is checked on numbers only."""

    def build(power):
        section = {"kind": "normalized_mlp", "fan_in_base": 64, "fan_in_power": power}
        return build_learned_optimizer(
            config_from_dict({"learned_optimizer": section}).learned_optimizer
        )

    assert "fan_in_power" in build("learned").init(jax.random.key(0))
    assert build(1.0).fan_in_power == 1.0
    with pytest.raises(
        ConfigError,
        match=r"learned_optimizer\.fan_in_power: expected float or one of 'learned', got 'fitted'",
    ):
        build("fitted")
    with pytest.raises(ConfigError, match=r"learned_optimizer\.fan_in_power: must be >= 0, got -1"):
        build(-1.0)


def test_a_name_registers_once_and_a_users_kind_takes_no_built_in_name():
    registry: Registry[int] = Registry("x", "Xs", "an int", returns=int)
    registry.register("a", "first")(lambda: 1)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a", "again")(lambda: 2)
    assert registry.resolve("a").build() == 1 and registry.names == ("a",) and "a" in registry

    def mine(width: int = 3) -> int:
        """My kind."""
        return width

    with pytest.raises(ValueError, match="'a' is a built-in kind"):
        registry.register_user_kind(mine, "a")
    kind = registry.register_user_kind(mine)
    assert (kind.name, kind.summary, [f.signature() for f in kind.fields]) == (
        "mine",
        "My kind.",
        ["width: int = 3"],
    )
    # Registered again (a notebook cell run twice): the newest definition wins.
    registry.register_user_kind(lambda width=4: width, "mine")
    assert registry.resolve("mine").build() == 4
    assert [k.name for k in registry] == ["a"]  # the docs list the built-in kinds
