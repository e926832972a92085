"""The two engines, and opening one with the runtime it needs.

The local engine runs the workers in the driver; the Ray engine runs them as
actors on an embedded Ray instance or a joined cluster. :func:`open_population`
is the one owner of Ray's lifetime: it starts Ray for the Ray engine (unless
the caller brings a population of its own) and shuts it down after the
population is closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from popmeta.actors.records import ActorInfo
from popmeta.config import ConfigError, PopulationConfig
from popmeta.experiment import WorkerSpec
from popmeta.population.base import Population
from popmeta.population.local import LocalPopulation
from popmeta.population.ray_population import RayPopulation, job_runtime_env
from popmeta.population.ray_runtime import start_ray_for
from popmeta.xla_flags import use_host_devices

__all__ = ["PopulationFactory", "describe_placement", "open_population", "prepare_driver"]

#: Builds a population from the ``population`` section and the workers' spec.
PopulationFactory = Callable[[PopulationConfig, WorkerSpec], Population]


def prepare_driver(population: PopulationConfig) -> None:
    """Sets up the driver's JAX for the engine; call it before the driver runs JAX.

    The local engine computes the estimates in the driver, so the driver
    starts ``cpu_devices`` CPU devices (actors start theirs themselves).

    Raises:
      ConfigError: if JAX already started in the driver with another number
        of CPU devices, or ``XLA_FLAGS`` sets another.
    """
    if population.engine == "local" and population.cpu_devices is not None:
        try:
            use_host_devices(population.cpu_devices)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@contextlib.contextmanager
def open_population(
    population: PopulationConfig,
    worker: WorkerSpec,
    factory: PopulationFactory | None = None,
    shipped_modules: Sequence[str] = (),
) -> Iterator[Population]:
    """The population ``population`` describes, with the runtime it needs, closed on exit.

    Args:
      population: the ``population`` section; ``engine`` picks the population.
      worker: what each worker is built from.
      factory: builds the population instead; the caller then owns whatever
        runtime it needs (e.g. a Ray instance a test session started).
      shipped_modules: directories of the user's kinds the driver found
        beside the config (``Config.found_modules``), shipped to Ray's job.

    Yields:
      The population. On exit it is closed, and then the Ray instance this
      function started (an embedded one; a joined cluster is left running).
    """
    pc = population
    if factory is not None:
        runtime: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    elif pc.engine == "local":
        runtime, factory = contextlib.nullcontext(), LocalPopulation
    else:
        runtime = start_ray_for(pc, job_runtime_env(pc.runtime_env, shipped_modules))
        factory = RayPopulation
    with runtime:
        opened = factory(pc, worker)
        try:
            yield opened
        finally:
            opened.close()


def describe_placement(pc: PopulationConfig, actors: list[ActorInfo]) -> str:
    """Where the population's workers run, in one line for the run's output."""
    split = sorted({actor.num_devices for actor in actors if actor.num_devices > 1})
    tasks_split = f", tasks split over {'/'.join(map(str, split))} devices" if split else ""
    if pc.engine == "local":
        return (
            f"{len(actors)} worker(s) in this process, one after another (local engine)"
            + tasks_split
        )
    nodes = {actor.node_id for actor in actors}
    text = f"{len(actors)} actor(s) on {len(nodes)} node(s)"
    pinned = [actor.pinned_cores for actor in actors]
    if any(pinned):
        text += ", pinned to cores " + " ".join(str(cores) for cores in pinned)
    text += tasks_split
    niced = sorted({actor.niceness for actor in actors if actor.niceness})
    if niced:
        text += (
            f"; the actors run at nice {'/'.join(map(str, niced))} (Ray's worker_niceness): "
            "any busy process on their nodes comes first. Start the cluster's nodes with "
            "RAY_worker_niceness=0 in their environment to give them a fair share"
        )
    return text
