"""Which modules read the config: the run's objects are built once and handed down as pieces.

``build_experiment`` builds a run's estimator, worker spec and learner start
from the config once; an actor receives a ``WorkerSpec``, and the learner,
populations, checkpoints, memory check and periodic evaluator take the
pieces they use. These tests keep it so: a module outside the short list
below that imports ``popmeta.config`` fails, and so does one that names the
whole ``Config`` outside the top of the run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layers import PACKAGE, imported_modules, module_name, unit_of

#: The units that name the whole ``Config``, and why.
WHOLE_CONFIG = {
    "popmeta.config": "defines it",
    "popmeta.experiment": "builds a run's objects from it, once",
    "popmeta.run_loop": "the run itself: hands the pieces down",
    "popmeta.evaluate": "meta-tests what a run's (or a checkpoint's) config names",
    "popmeta.run_identity": "a run directory's identity is its recorded config",
    "popmeta.cli": "loads and prints it",
    "popmeta": "the public namespace",
}

#: The units that read one section of it (or its error type) and no more.
ONE_SECTION = {
    "popmeta.population": "PopulationConfig: how many actors, where, which mode",
    "popmeta.footprint": "PopulationConfig, and ConfigError naming estimator.num_tasks",
    "popmeta.export": "the learned_optimizer section a trained optimizer was made with",
}


def _config_names(path: Path) -> list[tuple[int, set[str]]]:
    """(line, imported names) of every ``from popmeta.config import ...`` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("popmeta.config"):
            found.append((node.lineno, {alias.name for alias in node.names}))
    return found


def test_only_the_listed_units_import_the_config():
    readers = {**WHOLE_CONFIG, **ONE_SECTION}
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(module_name(path))
        for line, module in imported_modules(path):
            if unit_of(module) == "popmeta.config" and unit not in readers:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert problems == []


def test_only_the_top_of_the_run_names_the_whole_config():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(module_name(path))
        if unit in WHOLE_CONFIG:
            continue
        for line, names in _config_names(path):
            if "Config" in names:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports Config")
    assert problems == []


def test_a_worker_spec_crosses_to_an_actor_whole():
    import ray

    from popmeta.config import config_from_dict
    from popmeta.experiment import WorkerSpec

    config = config_from_dict({"task": {"kind": "fixed_dim_quadratic", "dim": 3}})
    spec = WorkerSpec.of(config)
    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(spec)) == spec
    assert spec.sections.task == config.task and spec.sections.seed == config.seed
