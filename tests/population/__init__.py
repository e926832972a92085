"""Population tests; shared helpers for the Ray population tests live here.

Each test uses real Ray processes and a tiny problem (a few quadratic tasks,
trajectories of 20 steps, truncations of 5, a learnable SGDM), so an actor is
ready and compiled within seconds.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import ray

from popmeta.actors.records import ActorInfo
from popmeta.config import Config, config_from_dict
from popmeta.experiment import WorkerSpec, learner_start
from popmeta.learner.learner import Learner
from popmeta.population.base import Gathered, Population
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation
from popmeta.population.ray_runtime import quiet_fork

__all__ = [
    "CALL_TIMEOUT_S",
    "local_population_of",
    "population_of",
    "quiet_fork",
    "run_updates",
    "stand_in_info",
    "tiny_config",
    "tree_bytes",
]

#: Longest wait for an actor's start and for one estimate in tests: far above a
#: tiny call (ms) plus a first compile (seconds, a minute when several actors
#: compile at once on a loaded 2-core machine: 60 s was too short there),
#: below the pytest timeouts. Tests of deadlines set their own.
CALL_TIMEOUT_S = 150.0


def tiny_config(
    *,
    num_tasks: int = 2,
    seed: int = 0,
    run_dir: str = "runs",
    num_steps: int = 4,
    **population: Any,
) -> Config:
    """A config whose actors start and compile in seconds; ``population`` overrides."""
    return config_from_dict(
        {
            "name": "test",
            "seed": seed,
            "run_dir": run_dir,
            "task": {"kind": "fixed_dim_quadratic", "dim": 4},
            "learned_optimizer": {"kind": "learnable_sgdm"},
            "truncation": {"kind": "constant", "length": 20},
            "estimator": {
                "kind": "pes",
                "num_tasks": num_tasks,
                "trunc_length": 5,
                "std": 0.01,
                "random_initial_iteration_offset": 20,
                # Not ``auto``: runs the tests compare must not size calls by measurement.
                "truncations_per_call": 1,
            },
            "outer_optimizer": {"kind": "adam", "learning_rate": 0.01},
            "population": {
                "engine": "ray",
                "num_actors": 2,
                "call_timeout_s": CALL_TIMEOUT_S,
                **population,
            },
            "train": {"num_steps": num_steps, "checkpoint_every": 1000, "summary_every": 1000},
            "eval": {"num_tasks": 2, "num_steps": 5},
        },
        source="test",
    )


def population_of(config: Config) -> RayPopulation:
    """The Ray population ``config`` describes, as the run loop opens it (Ray already running)."""
    return RayPopulation(config.population, WorkerSpec.of(config))


def local_population_of(config: Config) -> LocalPopulation:
    """The local engine's population ``config`` describes."""
    return LocalPopulation(config.population, WorkerSpec.of(config))


def run_updates(
    config: Config,
    population: Population,
    steps: int,
    on_gather: Callable[[Gathered], None] | None = None,
) -> Any:
    """``steps`` learner updates exactly as the training loop does them; returns theta."""
    learner = Learner.of(learner_start(config))
    for _ in range(steps):
        gathered = population.gather(learner.theta(), learner.version)
        if on_gather is not None:
            on_gather(gathered)
        learner.update(gathered.estimates)
    return learner.theta()


def tree_bytes(tree: Any) -> list[bytes]:
    """The exact bits of every leaf, for bitwise comparisons."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def stand_in_info(rank: int, restart: int) -> ActorInfo:
    """What a stand-in actor that computes no estimate reports from its ``info()``."""
    return ActorInfo(
        rank=rank,
        restart=restart,
        node_id=ray.get_runtime_context().get_node_id(),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        pinned_cores=None,
        num_devices=0,
        num_tasks=0,
        steps_per_estimate=0,
    )
