"""How much memory a run's workers need, checked against this machine before anything starts.

A worker holds its state (every inner problem, and per task the estimator's
accumulators: PES keeps one theta-sized perturbation per task) and, during
an estimate, XLA's working memory for the truncation (perturbed thetas, the
antithetic members' states, activations). Both grow with
``estimator.num_tasks``. The state's size is exact and free to compute
(``jax.eval_shape``); when it, or a bound on the perturbations, is more
than :data:`CHEAP_SHARE` of this machine's memory, the estimate is compiled
once without running it and XLA's own memory analysis gives its working memory.
A config whose workers cannot fit is refused, naming ``estimator.num_tasks``
and how many tasks would fit. Only workers on this machine's CPU are checked
(the local engine, or an embedded Ray instance with CPU-only actors); a
cluster's nodes, and accelerator memory, are not known before the actors start.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import numpy as np

from popmeta.config import ConfigError, PopulationConfig
from popmeta.core.estimators import GradientEstimator

__all__ = ["Footprint", "available_memory_bytes", "check_memory", "footprint"]

#: Below this share of the available memory a config is accepted without compiling.
CHEAP_SHARE = 0.05


class Footprint(NamedTuple):
    """Bytes one worker needs.

    Attributes:
      state: its state between estimates (exact).
      working: an estimate's live memory beyond the state: XLA's arguments,
        outputs and temporaries, less the donated state; None when not compiled.
    """

    state: int
    working: int | None


def _nbytes(tree: Any) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue
        total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    return total


def footprint(estimator: GradientEstimator, theta: Any, compile_estimate: bool) -> Footprint:
    """One worker's memory; ``compile_estimate``: also XLA's working memory.

    Args:
      estimator: the workers' estimator.
      theta: theta, or its template (``jax.ShapeDtypeStruct`` leaves).
      compile_estimate: also compile the estimate (not run it) for XLA's working memory.
    """
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = jax.eval_shape(estimator.init_worker_state, theta, key)
    if not compile_estimate:
        return Footprint(_nbytes(state), None)
    compiled = jax.jit(estimator.estimate, donate_argnums=1).lower(theta, state, key).compile()
    memory = compiled.memory_analysis()
    working = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    return Footprint(_nbytes(state), int(working) - _nbytes(state))


def available_memory_bytes() -> int | None:
    """Memory this machine can still give (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _workers_on_this_machine(pop: PopulationConfig) -> bool:
    if pop.engine == "local":
        return True
    joins = pop.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    return not joins and pop.num_gpus == 0 and not pop.resources


def _needed(population: PopulationConfig, worker: Footprint) -> int:
    """This machine's bytes for every worker, and the driver's copies of their states."""
    actors = population.num_actors
    working = worker.working or 0
    # The local engine runs one estimate at a time; each Ray actor holds its
    # own working memory. The driver holds every state while it checkpoints.
    if population.engine == "local":
        return 2 * actors * worker.state + working
    return 2 * actors * worker.state + actors * working


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def check_memory(
    estimator: GradientEstimator,
    theta: Any,
    population: PopulationConfig,
    available: int | None = None,
) -> None:
    """Refuses a run whose workers cannot fit in this machine's memory.

    Args:
      estimator: the workers' estimator.
      theta: theta, or its template.
      population: how many workers, and where they run.
      available: bytes to fit in; default :func:`available_memory_bytes`.

    Raises:
      ConfigError: naming ``estimator.num_tasks``, what it needs and how many
        tasks fit.
    """
    if not _workers_on_this_machine(population):
        return
    available = available_memory_bytes() if available is None else available
    if not available:
        return
    tasks = estimator.truncated_step.num_tasks
    worker = footprint(estimator, theta, compile_estimate=False)
    # Every ES-family estimator perturbs theta per task and antithetic member.
    bound = worker.state + 2 * _nbytes(theta) * tasks
    if _needed(population, worker._replace(working=bound)) < CHEAP_SHARE * available:
        return
    worker = footprint(estimator, theta, compile_estimate=True)
    needed = _needed(population, worker)
    if needed <= available:
        return
    fit = int(tasks * available / needed)
    raise ConfigError(
        f"estimator.num_tasks: {tasks} tasks per worker cannot fit in memory: one worker's "
        f"state takes {_gib(worker.state)} and an estimate works in {_gib(worker.working or 0)} "
        f"more, so {population.num_actors} "
        f"worker(s) on this machine and the driver's copies of their states at a checkpoint "
        f"need about {_gib(needed)}, and it has {_gib(available)} available. About {fit} "
        "tasks per worker would fit: lower estimator.num_tasks (or population.num_actors)"
    )
