"""The sections that name no kind: where the actors run, the training loop, meta-testing.

Each is a frozen dataclass whose ``_problems`` lists its fields' range
problems; :class:`~popmeta.config.schema.Config` collects them with the rules
that tie sections together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

from popmeta.config.kind_sections import TaskConfig
from popmeta.config.values import Problem, non_negative, positive
from popmeta.xla_flags import with_host_devices

__all__ = ["EvalConfig", "PopulationConfig", "TrainConfig"]


@dataclasses.dataclass(frozen=True)
class PopulationConfig:
    """The actors that compute estimates, and where they run.

    Attributes:
      num_actors: number of estimator actors (in single-process ``local``
        mode, the number of independent estimator seeds).
      mode: ``sync`` (one estimate per actor per version) or ``async``.
      batch_size: estimates aggregated per learner update in async mode.
      max_staleness: an estimate on theta version v is used at version u only
        if u - v <= max_staleness.
      num_cpus: CPUs declared per actor.
      num_gpus: GPUs declared per actor.
      resources: custom Ray resources per actor (e.g. ``{TPU: 4}``).
      pin_cpus: pin each actor's threads to a distinct CPU core of its node
        (CPU-only nodes), since XLA otherwise spreads every actor over all cores.
      address: Ray address to join (``auto``), or null for an embedded instance
        (``RAY_ADDRESS`` in the environment also joins a cluster).
      engine: ``ray`` (actors) or ``local`` (every worker in the driver, one
        after another, sync, no Ray). The local engine reads only
        ``num_actors``, ``shard_tasks``, ``cpu_devices`` and
        ``updates_per_call``, and refuses every Ray field set away from its
        default.
      one_actor_per_node_with: if set, start one actor on every node that
        carries this resource (e.g. ``TPU`` or ``GPU``) instead of
        ``num_actors`` actors (which must then stay unset).
      calls_in_flight: estimate calls queued per actor in async mode, so an
        actor never idles waiting for the learner.
      env: environment variables for the actors (e.g. ``XLA_FLAGS``); they join
        ``runtime_env``'s ``env_vars``.
      runtime_env: Ray's runtime environment for the actors, passed to Ray as it
        is (``working_dir``, ``py_modules``, ``pip``, ``env_vars``, ...): how the
        code of your own kinds reaches every node. The driver imports your
        modules from its local ``working_dir`` and ``py_modules`` too, and a
        module found only beside the config file is added to ``py_modules``.
      shard_tasks: an actor that sees several local devices shards its tasks over
        them (``estimator.num_tasks`` must then be a multiple of their number).
      cpu_devices: CPU devices JAX starts with in each process that computes
        estimates (every actor, or the driver with the local engine), the
        tasks split over them; null: JAX's own count (one, unless
        ``XLA_FLAGS`` says otherwise). One per core of such a process runs a
        compute-bound estimate faster, and a small problem's slower
        (docs/performance.md, "Tasks split over CPU devices").
      call_timeout_s: longest wait for an actor to start (build its worker and
        compile), and for one call before the population's calls are timed.
      call_timeout_factor: a busy actor silent for this many times the slowest
        of the population's recent calls (before its first calls, of its
        actors' starts) is lost and replaced (a warning comes at half that
        time); the wait is at least ``min_call_timeout_s`` and at most
        ``call_timeout_s``.
      min_call_timeout_s: the shortest wait before a silent actor is lost.
      max_actor_restarts: times one rank may be replaced in a row, without a
        reply in between, before the run gives up (a crash loop); losses of
        actors that delivered in between never add up.
      compiled_graph: sync rounds reach each actor through a Ray compiled graph
        (shared-memory channels) instead of an actor call: less overhead per
        round (docs/performance.md), but the driver busy-waits on a core while
        the actors compute. Sync mode only.
      updates_per_call: the local engine compiles up to this many rounds
        (every worker's estimate and the learner's step) into one program,
        so the host dispatches once per call instead of several times per
        update (docs/population.md, "Fused rounds"); the same updates, only
        the rounding may differ. Local engine only; tasks with their data on
        the device (split over devices or not).
    """

    num_actors: int = 2
    mode: Literal["sync", "async"] = "sync"
    batch_size: int = 1
    max_staleness: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    pin_cpus: bool = True
    address: str | None = None
    engine: Literal["local", "ray"] = "ray"
    one_actor_per_node_with: str | None = None
    calls_in_flight: int = 2
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    runtime_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    shard_tasks: bool = True
    cpu_devices: int | None = None
    call_timeout_s: float = 600.0
    call_timeout_factor: float = 10.0
    min_call_timeout_s: float = 10.0
    max_actor_restarts: int = 10
    compiled_graph: bool = False
    updates_per_call: int = 1

    def _problems(self) -> Iterator[Problem]:
        yield from positive(
            self,
            "num_actors",
            "batch_size",
            "calls_in_flight",
            "call_timeout_s",
            "call_timeout_factor",
            "min_call_timeout_s",
            "updates_per_call",
        )
        if self.updates_per_call > 1 and self.engine != "local":
            yield (
                "updates_per_call",
                "fuses the local engine's rounds into one program (engine: local); the Ray "
                "engine's rounds cross processes: use estimator.truncations_per_call there",
            )
        if self.compiled_graph and self.mode != "sync":
            yield "compiled_graph", "works in mode: sync only (async calls queue up on the actors)"
        yield from non_negative(self, "max_staleness", "num_cpus", "num_gpus", "max_actor_restarts")
        if self.cpu_devices is not None and self.cpu_devices < 1:
            yield (
                "cpu_devices",
                f"must be a number of devices >= 1, or null; got {self.cpu_devices!r}",
            )
        elif self.cpu_devices is not None:
            if not self.shard_tasks:
                yield (
                    "cpu_devices",
                    "splits the tasks over devices, which shard_tasks: false forbids",
                )
            try:
                with_host_devices(self.env.get("XLA_FLAGS", ""), self.cpu_devices)
            except ValueError as err:
                yield "env", str(err)
        if self.one_actor_per_node_with is not None and not self.one_actor_per_node_with:
            yield "one_actor_per_node_with", "must be a resource name or null"
        for name, amount in self.resources.items():
            if not name:
                yield "resources", "resource names must be non-empty"
            elif name in ("CPU", "GPU"):
                yield f"resources.{name}", f"use population.num_{name.lower()}s for {name}s"
            elif not amount >= 0:
                yield f"resources.{name}", f"must be >= 0, got {amount!r}"
        if self.address is not None and not self.address.strip():
            yield "address", "must be non-empty or null"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The meta-training loop.

    Attributes:
      num_steps: learner (outer) updates.
      log_every: progress/console logging period, in learner steps.
      checkpoint_every: checkpoint period, in learner steps.
      keep_checkpoints: how many recent checkpoints to keep.
      summary_every: TensorBoard summary period, in learner steps.
    """

    num_steps: int = 20000
    log_every: int = 1000
    checkpoint_every: int = 2000
    keep_checkpoints: int = 3
    summary_every: int = 10

    def _problems(self) -> Iterator[Problem]:
        yield from positive(
            self, "num_steps", "log_every", "checkpoint_every", "keep_checkpoints", "summary_every"
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Meta-testing of a learned optimizer (``popmeta eval``, the end of a run, ``every``).

    Attributes:
      num_tasks: held-out inner problems per setting; the 95% intervals are over them.
      num_steps: inner steps of the trained-horizon setting; None means the
        longest trajectory of the truncation schedule (its ``max_length``).
      long_horizon_factors: a further setting for each factor, running
        ``factor * num_steps`` steps on the training task family (``[]``: none).
      each_training_family: with a mixture, the trained horizon and the long
        horizons run on every member (settings named ``<label>: ...``), not
        only on the task section's own kind.
      optax_cosine: a further setting at the trained horizon where the learned
        optimizer runs as exported (``popmeta.load_optimizer``), chained with
        an external cosine decay of its updates to 0 over the run.
      out_of_distribution: further settings, each a name and a ``task`` section
        (other architectures, other data), run at the trained horizon.
      seed: evaluation seed (separate from the training seed); baselines are
        tuned on tasks drawn from ``seed + 1``, disjoint from the test tasks.
      every: also evaluate the learned optimizer every this many learner steps
        while training, in the background, logged under ``eval/`` (0: never).
      after_training: compare the trained learned optimizer with the tuned
        baselines at the trained horizon when a run finishes.
      tuning: how each baseline's learning rate is chosen from the grid:
        ``full`` runs all 21 rates; ``coarse_to_fine`` runs every fourth
        (one per decade), then the six grid rates around the best of those:
        12 runs, the same choice wherever the tuning loss is unimodal over
        the grid.
      tuning_tasks: tuning tasks each learning rate runs on; None means
        ``num_tasks``. A rate is chosen by the mean over tasks of a mean
        training loss, which varies little between tasks: a few of them
        choose what many do at a fraction of the cost.
    """

    num_tasks: int = 32
    num_steps: int | None = None
    long_horizon_factors: tuple[int, ...] = (5,)
    each_training_family: bool = False
    optax_cosine: bool = False
    out_of_distribution: dict[str, TaskConfig] = dataclasses.field(default_factory=dict)
    seed: int = 1234
    every: int = 0
    after_training: bool = True
    tuning: Literal["full", "coarse_to_fine"] = "coarse_to_fine"
    tuning_tasks: int | None = None

    def _problems(self) -> Iterator[Problem]:
        yield from positive(self, "num_tasks", "num_steps", "tuning_tasks")
        yield from non_negative(self, "seed", "every")
        for i, factor in enumerate(self.long_horizon_factors):
            if not factor > 1:
                yield f"long_horizon_factors[{i}]", f"must be > 1, got {factor!r}"
        if self.num_tasks is not None and self.num_tasks < 2:
            yield "num_tasks", f"must be >= 2 for an interval over tasks, got {self.num_tasks!r}"
        for name, task in self.out_of_distribution.items():
            for field, message in task._problems():
                yield f"out_of_distribution.{name}.{field}", message
            if task.mixture:
                yield (
                    f"out_of_distribution.{name}.mixture",
                    "meta-testing runs on one family (its kind); remove mixture",
                )
            if task.rescaled:
                yield (
                    f"out_of_distribution.{name}.rescale_per_tensor",
                    "rescaling is a training augmentation; meta-testing runs the plain family",
                )
