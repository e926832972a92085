"""A tiny local-engine run config shared by the run-loop and run-directory tests."""

from __future__ import annotations

from typing import Any

from popmeta.config import Config, PopulationConfig, config_from_dict
from popmeta.experiment import WorkerSpec

__all__ = ["local_config", "no_population"]


def local_config(run_dir: Any, name: str = "ident", **sections: dict[str, Any]) -> Config:
    """Quadratics with learnable SGD on the local engine; ``sections`` update the defaults."""
    base: dict[str, Any] = {
        "name": name,
        "run_dir": str(run_dir),
        "task": {"kind": "fixed_dim_quadratic", "dim": 3},
        "learned_optimizer": {"kind": "learnable_sgd"},
        "truncation": {"kind": "constant", "length": 10},
        # One truncation per call, not ``auto``: runs the tests compare bit for bit
        # must not size their calls by a measurement each.
        "estimator": {
            "num_tasks": 2,
            "trunc_length": 5,
            "random_initial_iteration_offset": 10,
            "truncations_per_call": 1,
        },
        "outer_optimizer": {"learning_rate": 0.01},
        "population": {"engine": "local"},
        "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 2},
        # The comparison with tuned baselines compiles a grid per baseline: only
        # the tests of the evaluation itself pay for it.
        "eval": {"num_tasks": 2, "num_steps": 5, "after_training": False},
    }
    for section, values in sections.items():
        # Another kind brings fields of its own: the section is replaced, not merged.
        known = base.get(section, {}).get("kind")
        other_kind = "kind" in values and known is not None and values["kind"] != known
        base[section] = dict(values) if other_kind else {**base.get(section, {}), **values}
    return config_from_dict(base)


def no_population(population: PopulationConfig, worker: WorkerSpec):
    """A population factory for starts that must fail before any population starts."""
    raise AssertionError("no population may start")
