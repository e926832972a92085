"""The package's layers: every import points down (or stays inside its own unit).

``LAYERS`` is the one place the layer order is written, bottom first. A unit
is a module or a subpackage of ``popmeta``; a module may import from its own
unit and from units of lower layers, never from a higher layer and never from
another unit of its own layer (units that share a layer are independent).
Imports inside functions count too: a function-level import is no way around
a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "popmeta"

#: Bottom first. ``popmeta`` itself (the flat public namespace) is the top.
LAYERS: list[list[str]] = [
    # pure JAX: tasks, optimizers, truncated steps, estimators; XLA flags for CPU; the progress line
    ["popmeta.core", "popmeta.xla_flags", "popmeta.accelerator_memory", "popmeta.progress"],
    ["popmeta.registry"],  # the kinds a config may name, and their builders
    ["popmeta.config"],  # typed config schema, YAML, overrides, validation
    ["popmeta.experiment", "popmeta.estimate"],  # config -> core objects; the wire record
    # theta + outer step; the estimator workers; their memory, checked up front
    ["popmeta.learner", "popmeta.actors", "popmeta.footprint"],
    ["popmeta.population", "popmeta.storage"],  # placement, gather; local or remote files
    ["popmeta.summaries", "popmeta.run_dir"],  # TensorBoard; a run directory's identity
    # meta-testing; a run's checkpoints; which changes a resumed run may make; stop signals
    ["popmeta.evaluate", "popmeta.run_checkpoints", "popmeta.run_identity", "popmeta.run_signals"],
    ["popmeta.run_loop", "popmeta.export"],  # the run loop; a trained optimizer as a file
    ["popmeta.cli", "popmeta.__main__"],  # the command line
    ["popmeta"],  # the public namespace re-exports everything
]


def _layer_of() -> dict[str, int]:
    return {unit: index for index, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """The longest ``LAYERS`` unit that ``module`` is, or lies inside."""
    units = [u for u in _layer_of() if module == u or module.startswith(u + ".")]
    if not units:
        raise AssertionError(f"{module} belongs to no unit of LAYERS; add it there")
    return max(units, key=len)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every ``popmeta`` import in the file, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from popmeta import run_loop` imports the submodule popmeta.run_loop.
            if module == "popmeta":
                found += [(node.lineno, f"popmeta.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in found if m == "popmeta" or m.startswith("popmeta.")]


def upward_imports() -> list[str]:
    layer = _layer_of()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        own = unit_of(importer)
        for line, module in imported_modules(path):
            if module == "popmeta" and own != "popmeta":
                problems.append(f"{path.name}:{line} imports the top-level namespace")
                continue
            target = unit_of(module)
            if target == own:
                continue
            if layer[target] >= layer[own]:
                problems.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {own} (layer {layer[own]}) "
                    f"imports {module} ({target}, layer {layer[target]})"
                )
    return problems


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        unit_of(module_name(path))


def test_no_import_points_up_or_sideways():
    assert upward_imports() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    # A learner module that imports the run loop must be reported.
    fake = tmp_path / "popmeta"
    (fake / "learner").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "learner" / "__init__.py").write_text("")
    (fake / "learner" / "bad.py").write_text(
        "def f():\n    from popmeta.run_loop import train\n    return train\n"
    )
    (fake / "train.py").write_text("from .learner import bad\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    problems = upward_imports()
    assert (
        len(problems) == 1 and "popmeta.learner (layer 4) imports popmeta.run_loop" in problems[0]
    )


@pytest.mark.parametrize("module", ["popmeta.core.tasks.base", "popmeta.learner.learner"])
def test_units_are_found_for_nested_modules(module):
    assert unit_of(module) in {"popmeta.core", "popmeta.learner"}


def test_the_public_namespace_exports_exactly_what_it_lists():
    import popmeta

    assert sorted(set(popmeta.__all__)) == sorted(popmeta.__all__)
    missing = [name for name in popmeta.__all__ if not hasattr(popmeta, name)]
    assert missing == []
